"""Loading a snapshot's weights into a model, memory-mapped, for the engine's first load and every wake.

The fast path builds the model from its config without allocating any weight (parameters on the
meta device, no initialisation: it would be overwritten), then assigns into it the tensors that
`safetensors.safe_open` hands out. Those are views of a private (copy-on-write) mapping of the
file, not copies: the weights are page-cache pages, no anonymous memory of their own, and they come
at memory speed when the snapshot is warm (the page-cache tier), at disk speed when it is cold
(measured: a cold load reads as fast as `dd`). A tensor stored in another dtype than the model
wants is converted, and a conversion is a copy (bf16 → fp32 doubles it).

Non-persistent buffers (rotary `inv_freq`) are not in checkpoints: they are built for real while
the module tree is built, exactly as transformers computes them after its own load.

When the checkpoint's names do not map 1:1 onto the model (another layout, a prefix, renamed or
missing tensors, other shapes), nothing is assigned and transformers' `from_pretrained` loads the
snapshot instead, which knows those conversions; the reason is logged. With transformers 5.24 that
path maps fp32 weights without a copy too; what it adds is time in its per-tensor loading
machinery (SmolLM2-135M, load + touch: 2.7× slower warm, 1.5× cold; bench/engine_bench.py).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from pathlib import Path

import torch
from accelerate import init_empty_weights
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel

log = logging.getLogger("stoker.engine")

MMAP = "mmap"
FROM_PRETRAINED = "from_pretrained"


def load_model(snapshot_dir: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, str]:
    """The snapshot's model in eval mode, and which path loaded it: `MMAP` or `FROM_PRETRAINED`."""
    model = empty_model(snapshot_dir, dtype)
    reason = assign_weights(model, snapshot_dir)
    if reason is None:
        generation = snapshot_dir / "generation_config.json"
        if generation.is_file():  # from_pretrained reads it too: it holds the EOS ids to stop at
            model.generation_config = GenerationConfig.from_pretrained(snapshot_dir)
        return model.eval(), MMAP
    log.warning("weights: %s; loading through transformers' from_pretrained instead", reason)
    return from_pretrained(snapshot_dir, dtype), FROM_PRETRAINED


def from_pretrained(snapshot_dir: Path, dtype: torch.dtype) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(snapshot_dir, dtype=dtype).eval()


def empty_model(snapshot_dir: Path, dtype: torch.dtype) -> PreTrainedModel:
    """The model's module tree with every parameter on the meta device and real buffers."""
    config = AutoConfig.from_pretrained(snapshot_dir)
    # Initialising 135 M meta parameters still costs ~0.25 s of torch dispatch: skip it.
    with init_empty_weights(include_buffers=False), _no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.requires_grad_(False)


def assign_weights(model: PreTrainedModel, snapshot_dir: Path) -> str | None:
    """Assign the snapshot's safetensors, memory-mapped, into `model`'s meta parameters.

    Returns None when every parameter and buffer is real afterwards; otherwise why the checkpoint
    does not fit the model. A mismatch found in the files' headers assigns nothing.
    """
    files = sorted(snapshot_dir.glob("*.safetensors"))
    if not files:
        return f"no *.safetensors file in {snapshot_dir}"
    shapes = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            shapes.update({key: tuple(f.get_slice(key).get_shape()) for key in f.keys()})
    expected = model.state_dict()  # parameters and persistent buffers, tied names included
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    may_be_absent = set(tied) | set(tied.values())  # one of a tied pair is enough
    if reason := _mismatch(shapes, expected, may_be_absent):
        return reason

    weights, converted = {}, 0
    for path in files:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                tensor = f.get_tensor(key)  # a view of the file's mapping: no copy
                want = expected[key].dtype
                if tensor.dtype != want:
                    tensor, converted = tensor.to(want), converted + tensor.numel() * want.itemsize
                weights[key] = tensor
    model.load_state_dict(weights, strict=False, assign=True)
    model.tie_weights(missing_keys=set(expected) - set(weights))
    if left := [name for name, t in _tensors(model) if t.is_meta]:
        return f"{len(left)} tensor(s) still unloaded after tying, e.g. {left[0]!r}"
    copied = f"; {converted / 1e6:.1f} MB converted to the model's dtype (a copy)" if converted else ""
    log.info(
        "weights: memory-mapped %d tensors from %s%s", len(weights), ", ".join(p.name for p in files), copied
    )
    return None


def _mismatch(shapes: dict[str, tuple], expected: dict[str, torch.Tensor], may_be_absent: set[str]) -> str:
    unexpected = sorted(set(shapes) - set(expected))
    missing = sorted(set(expected) - set(shapes) - may_be_absent)
    wrong = sorted(k for k in set(shapes) & set(expected) if shapes[k] != tuple(expected[k].shape))
    found = (
        ("checkpoint tensor(s) not in the model", unexpected),
        ("model tensor(s) missing from the checkpoint", missing),
        ("tensor(s) of another shape than the model's", wrong),
    )
    return "; ".join(f"{len(keys)} {what} (e.g. {keys[0]!r})" for what, keys in found if keys)


def _tensors(model: torch.nn.Module):
    return itertools.chain(model.named_parameters(), model.named_buffers())


def _no_init_weights():
    # transformers' own switch (what from_pretrained uses); a later rename only costs speed.
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # pragma: no cover
        return contextlib.nullcontext()
    return no_init_weights()
