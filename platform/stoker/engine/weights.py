"""A snapshot's weights in the engine's model: loaded onto the device, moved off it for sleep, put back.

The fast path builds the model from its config without allocating any weight (parameters on the
meta device, no initialisation: it would be overwritten), then assigns into it the tensors that
`safetensors.safe_open` hands out. Those are views of a private (copy-on-write) mapping of the
file, not copies: the weights are page-cache pages, no anonymous memory of their own, and they come
at memory speed when the snapshot is warm (the page-cache tier), at disk speed when it is cold
(measured: a cold load reads as fast as `dd`). A tensor stored in another dtype than the model
wants is converted, and a conversion is a copy (bf16 → fp32 doubles it).

On a GPU the same mapped views are the source of one copy each to the device, through two reused
pinned buffers (`_Staging` says why not safetensors' own `device=`).

Non-persistent buffers (rotary `inv_freq`) are not in checkpoints: they are built for real while
the module tree is built, exactly as transformers computes them after its own load, then moved to
the device.

When the checkpoint's names do not map 1:1 onto the model (another layout, a prefix, renamed or
missing tensors, other shapes), nothing is assigned and transformers' `from_pretrained` loads the
snapshot instead, which knows those conversions; the reason is logged. With transformers 5.24 that
path maps fp32 weights without a copy too; what it adds is time in its per-tensor loading
machinery (SmolLM2-135M, load + touch: 2.7× slower warm, 1.5× cold; bench/engine_bench.py).

Sleep (`sleep_plan`, `put_to_sleep`, `wake`): on the CPU both levels drop every weight to the meta
device and wake maps the snapshot again, since the weights were page-cache pages to begin with. On
a GPU, level 1 copies the weights into pinned host buffers of 1 GiB and frees the device memory;
wake copies each buffer back in one transfer. Level 2 drops them on either device.

This module needs torch, transformers and safetensors only (no accelerate): bench/gpu_check.py
imports it on GPU machines that have nothing else.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import logging
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel

log = logging.getLogger("stoker.engine")

MMAP = "mmap"
FROM_PRETRAINED = "from_pretrained"
DEVICES = ("cpu", "cuda")
# Two pinned buffers of this size carry a load to the GPU: large enough that each DMA runs at the
# link's full speed, small enough to pin in milliseconds (pinning all 16 GB of an 8B model first
# would cost seconds).
STAGING_BYTES = 64 << 20
# Sleep on a GPU packs the weights into host buffers of this size. torch's pinned allocator rounds
# every allocation up to a power of two: one buffer for Llama-3-8B's 15 GiB would take 16 GiB, for a
# 17 GiB model 32; one per tensor, each 112 MiB MLP weight takes 128. 1 GiB buffers are powers of two
# already (only the last rounds up), and each is still one transfer at the link's full speed.
HOST_CHUNK_BYTES = 1 << 30
ALIGN = 4096  # each tensor starts this far into its buffer: aligned for every dtype and vector load


def choose_device(requested: str, cuda_available: bool) -> str:
    """`auto` is `cuda` when torch sees a GPU, else `cpu`; asking for `cuda` without one is a ValueError."""
    if requested == "auto":
        return "cuda" if cuda_available else "cpu"
    if requested not in DEVICES:
        raise ValueError(f"device must be one of auto, {', '.join(DEVICES)}; got {requested!r}")
    if requested == "cuda" and not cuda_available:
        raise ValueError("--device cuda, but torch sees no CUDA GPU (torch.cuda.is_available() is false)")
    return requested


# ---- loading ---------------------------------------------------------------------------------------


def load_model(snapshot_dir: Path, dtype: torch.dtype, device: str = "cpu") -> tuple[PreTrainedModel, str]:
    """The snapshot's model on `device`, in eval mode, and which path loaded it: `MMAP` or `FROM_PRETRAINED`."""
    model = empty_model(snapshot_dir, dtype, device)
    reason = assign_weights(model, snapshot_dir, device)
    if reason is None:
        generation = snapshot_dir / "generation_config.json"
        if generation.is_file():  # from_pretrained reads it too: it holds the EOS ids to stop at
            model.generation_config = GenerationConfig.from_pretrained(snapshot_dir)
        return model.eval(), MMAP
    log.warning("weights: %s; loading through transformers' from_pretrained instead", reason)
    return from_pretrained(snapshot_dir, dtype, device), FROM_PRETRAINED


def from_pretrained(snapshot_dir: Path, dtype: torch.dtype, device: str = "cpu") -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(snapshot_dir, dtype=dtype)
    # Loaded on the CPU, then moved: device_map would need accelerate, and this is the fallback path.
    return (model if _on_cpu(device) else model.to(device)).eval()


def empty_model(snapshot_dir: Path, dtype: torch.dtype, device: str = "cpu") -> PreTrainedModel:
    """The model's module tree with every parameter on the meta device and real buffers on `device`."""
    config = AutoConfig.from_pretrained(snapshot_dir)
    # Initialising 135 M meta parameters still costs ~0.25 s of torch dispatch: skip it.
    with _parameters_on_meta(), _no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if not _on_cpu(device):
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to(device)
    return model.requires_grad_(False)


def assign_weights(model: PreTrainedModel, snapshot_dir: Path, device: str = "cpu") -> str | None:
    """Assign the snapshot's safetensors, memory-mapped, into `model`'s meta parameters, on `device`.

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

    t0 = time.perf_counter()
    if _on_cpu(device):
        weights, converted = _mapped(files, expected)
    else:
        weights, converted = _copied(files, expected, device)
    model.load_state_dict(weights, strict=False, assign=True)
    model.tie_weights(missing_keys=set(expected) - set(weights))
    if left := [name for name, t in _tensors(model) if t.is_meta]:
        return f"{len(left)} tensor(s) still unloaded after tying, e.g. {left[0]!r}"
    copied = f"; {converted / 1e6:.1f} MB converted to the model's dtype (a copy)" if converted else ""
    names = ", ".join(p.name for p in files)
    if _on_cpu(device):
        log.info("weights: memory-mapped %d tensors from %s%s", len(weights), names, copied)
    else:
        seconds = time.perf_counter() - t0
        size = sum(p.stat().st_size for p in files)
        log.info(
            "weights: copied %d tensors from %s to %s in %.2f s (%.1f GB/s)%s",
            len(weights),
            names,
            device,
            seconds,
            size / seconds / 1e9 if seconds > 0 else 0.0,
            copied,
        )
    return None


def _mapped(files: list[Path], expected: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
    weights, converted = {}, 0
    for path in files:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                tensor = f.get_tensor(key)  # a view of the file's mapping: no copy
                want = expected[key].dtype
                if tensor.dtype != want:
                    tensor, converted = tensor.to(want), converted + tensor.numel() * want.itemsize
                weights[key] = tensor
    return weights, converted


def _copied(
    files: list[Path], expected: dict[str, torch.Tensor], device: str
) -> tuple[dict[str, torch.Tensor], int]:
    weights, converted = {}, 0
    staging = _Staging(device)  # 128 MiB pinned, handed back below
    try:
        for path in files:
            with safe_open(path, framework="pt") as f:
                # In file order, so a cold file is read front to back, as readahead expects.
                for key in _in_file_order(path):
                    tensor = staging.copy(f.get_tensor(key))
                    want = expected[key].dtype
                    if tensor.dtype != want:  # converted on the device: the GPU does it at memory speed
                        tensor, converted = tensor.to(want), converted + tensor.numel() * want.itemsize
                    weights[key] = tensor
        staging.finish()
    finally:
        staging.buffers.clear()
        release_pinned()
    return weights, converted


class _Staging:
    """Copies memory-mapped tensors to the GPU through two pinned buffers that take turns.

    Why not safetensors' `safe_open(..., device="cuda")`: it calls `.to(device)` on each mapped
    tensor, a copy from pageable memory, which CUDA stages through a driver buffer with one CPU
    thread, and each call returns only once its tensor is on the device, so reading the file and the
    DMA take turns. Here the copy from the mapping into a pinned buffer is torch's own CPU copy,
    spread over all intra-op threads (page faults, and on a cold file the disk reads, run in
    parallel), and the DMA out of one buffer (`non_blocking`, which is asynchronous only from pinned
    memory) overlaps the filling of the other. bench/gpu_check.py measures both ways.
    """

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        self.buffers = [torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.done: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0

    def copy(self, src: torch.Tensor) -> torch.Tensor:
        dst = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        src_bytes, dst_bytes = _as_bytes(src.contiguous()), _as_bytes(dst)
        for start in range(0, src_bytes.numel(), STAGING_BYTES):
            n = min(STAGING_BYTES, src_bytes.numel() - start)
            buffer, done = self.buffers[self.turn], self.done[self.turn]
            if done is not None:
                done.synchronize()  # the DMA out of this buffer has finished: it may be refilled
            buffer[:n].copy_(src_bytes[start : start + n])
            dst_bytes[start : start + n].copy_(buffer[:n], non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self.done[self.turn], self.turn = event, 1 - self.turn
        return dst

    def finish(self) -> None:
        torch.cuda.synchronize(self.device)


def _in_file_order(path: Path) -> list[str]:
    """The tensor names of a safetensors file by their offset in it (`keys()` gives them by name)."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return sorted(header, key=lambda key: header[key]["data_offsets"][0])


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


@contextlib.contextmanager
def _parameters_on_meta():
    """Every parameter registered inside goes to the meta device; buffers stay real.

    accelerate's `init_empty_weights(include_buffers=False)`, written out here so that the engine,
    and bench/gpu_check.py on a bare GPU machine, do not need accelerate for it.
    """
    register = torch.nn.Module.register_parameter

    def register_on_meta(module: torch.nn.Module, name: str, param) -> None:
        register(module, name, param)
        if param is not None:
            kwargs = module._parameters[name].__dict__
            kwargs["requires_grad"] = param.requires_grad
            hf_initialized = kwargs.pop("_is_hf_initialized", None)  # not a constructor argument
            module._parameters[name] = type(param)(module._parameters[name].to("meta"), **kwargs)
            if hf_initialized is not None:
                module._parameters[name]._is_hf_initialized = hf_initialized

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def _no_init_weights():
    # transformers' own switch (what from_pretrained uses); a later rename only costs speed.
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # pragma: no cover
        return contextlib.nullcontext()
    return no_init_weights()


# ---- sleep and wake ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SleepPlan:
    """What one sleep level does with the weights on one device."""

    to_host: bool  # kept in pinned host memory, copied back on wake; else dropped, reloaded from the snapshot
    drop_page_cache: bool  # the snapshot's files leave the page cache too: the wake reads the disk


def sleep_plan(level: int, device: str) -> SleepPlan:
    """The sleep levels, as vLLM defines them, on the CPU and on a GPU.

    | device | level | weights                                    | page cache |
    |--------|-------|--------------------------------------------|------------|
    | cpu    | 1     | dropped; wake maps the snapshot again      | kept       |
    | cpu    | 2     | dropped; wake maps the snapshot again      | dropped    |
    | cuda   | 1     | to pinned host memory; wake copies it back | kept       |
    | cuda   | 2     | dropped; wake loads the snapshot again     | dropped    |

    On the CPU the weights are the snapshot's page-cache pages: a host copy would double them, and
    while those pages stay cached a wake maps them again at memory speed. On a GPU the weights are
    device memory: level 1 keeps a host copy so that a wake is one host-to-device transfer.
    """
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
    return SleepPlan(to_host=level == 1 and not _on_cpu(device), drop_page_cache=level == 2)


def put_to_sleep(model: PreTrainedModel, plan: SleepPlan) -> None:
    """Take the weights off the device as `plan` says and hand the freed memory back."""
    device = next(model.parameters()).device
    if plan.to_host:
        offload(model)
    else:
        drop(model)
    gc.collect()  # the batching manager's KV cache and the old weights may sit in reference cycles
    if device.type == "cuda":
        torch.cuda.empty_cache()  # torch's allocator keeps freed blocks for reuse: give them to the driver


def wake(model: PreTrainedModel, plan: SleepPlan, snapshot_dir: Path, device: str) -> str | None:
    """Put the weights back on `device` after `put_to_sleep(model, plan)`; as `assign_weights` returns."""
    if plan.to_host:
        onload(model, device)
        return None
    return assign_weights(model, snapshot_dir, device)


def drop(model: torch.nn.Module) -> None:
    """Replace every parameter by one on the meta device: shapes stay, so weights can be assigned again."""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                meta = torch.empty(param.shape, dtype=param.dtype, device="meta")
                module._parameters[name] = torch.nn.Parameter(meta, requires_grad=False)


def offload(model: torch.nn.Module, chunk_bytes: int = HOST_CHUNK_BYTES) -> None:
    """Copy every parameter into host buffers (pinned when they are on a GPU) and point them there.

    The buffers are `chunk_bytes` each (`HOST_CHUNK_BYTES` says why), tensors packed in order; a
    larger tensor gets one of its own. Tied parameters stay one parameter.
    """
    slots, params = _parameter_slots(model)
    places, sizes = pack([p.nbytes for p in params], chunk_bytes)
    on_gpu = params[0].device.type == "cuda"
    hosts = [torch.empty(n, dtype=torch.uint8, pin_memory=on_gpu) for n in sizes]
    moved = {}
    for param, (chunk, offset) in zip(params, places, strict=True):
        view = _view(hosts[chunk], offset, param)
        view.copy_(param, non_blocking=on_gpu)  # into pinned memory: the copies queue, one wait below
        moved[id(param)] = view
    if on_gpu:
        torch.cuda.synchronize(params[0].device)
    _replace(slots, moved)


def onload(model: torch.nn.Module, device: str) -> None:
    """Move the parameters `offload` put in host buffers to `device`: one copy per buffer.

    Each host buffer becomes one device buffer, and the parameters views of it at the same offsets.
    The pinned buffers go back to torch's host allocator, which keeps them: `release_pinned` hands
    them to the OS.
    """
    slots, params = _parameter_slots(model)
    if on_device := [p for p in params if p.device.type != "cpu"]:
        raise RuntimeError(
            f"onload: {len(on_device)} parameter(s) not in host memory; offload puts them there"
        )
    flats: dict[int, torch.Tensor] = {}
    for p in params:
        storage = p.untyped_storage()
        if storage.data_ptr() not in flats:
            host = torch.empty(0, dtype=torch.uint8).set_(storage)
            flat = torch.empty(host.numel(), dtype=torch.uint8, device=device)
            flat.copy_(host, non_blocking=True)  # from pinned memory: a DMA at the link's own speed
            flats[storage.data_ptr()] = flat
    moved = {
        id(p): _view(flats[p.untyped_storage().data_ptr()], p.storage_offset() * p.element_size(), p)
        for p in params
    }
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    _replace(slots, moved)


def pack(sizes: list[int], chunk_bytes: int = HOST_CHUNK_BYTES) -> tuple[list[tuple[int, int]], list[int]]:
    """Place tensors of `sizes` bytes, in order, into buffers of at most `chunk_bytes`, each tensor
    at an `ALIGN`ed offset; one larger than a buffer gets a buffer of its own.

    Returns (buffer, offset) for each tensor and each buffer's size. With 16 KiB buffers, tensors
    of 5000, 100 and 9000 bytes: the first at (0, 0); the second at the next 4 KiB, (0, 8192),
    ending at 8292; the third would end at 12288 + 9000 > 16384, so it starts buffer 1 at (1, 0).
    Sizes: [8292, 9000].
    """
    places: list[tuple[int, int]] = []
    ends: list[int] = []
    for n in sizes:
        start = -(-ends[-1] // ALIGN) * ALIGN if ends else 0
        if not ends or (start + n > chunk_bytes and ends[-1] > 0):
            ends.append(0)
            start = 0
        places.append((len(ends) - 1, start))
        ends[-1] = start + n
    return places, [max(end, 1) for end in ends]


def release_pinned() -> None:
    """Give the pinned host memory torch keeps cached for reuse back to the OS (nothing on the CPU)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)  # torch ≥ 2.9
    empty = empty or getattr(torch._C, "_host_emptyCache", None)  # older torch
    if empty is not None:
        empty()


def _parameter_slots(model: torch.nn.Module):
    """Every (module, name, parameter), and each distinct parameter once: tied ones appear twice in the first."""
    slots = [(m, n, p) for m in model.modules() for n, p in m._parameters.items() if p is not None]
    params = list({id(p): p for _, _, p in slots}.values())  # the slots hold each alive: ids stay unique
    return slots, params


def _view(flat: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    return flat[offset : offset + like.nbytes].view(like.dtype).view(like.shape)


def _replace(slots, moved: dict[int, torch.Tensor]) -> None:
    params = {}
    for module, name, param in slots:
        if id(param) not in params:
            params[id(param)] = torch.nn.Parameter(moved[id(param)], requires_grad=False)
        module._parameters[name] = params[id(param)]


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _on_cpu(device: str | torch.device) -> bool:
    return torch.device(device).type == "cpu"
