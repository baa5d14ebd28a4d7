"""PEFT LoRA adapters: what one is, read from its files without loading a tensor, and whether it fits a base.

An adapter directory holds `adapter_config.json` and `adapter_model.safetensors` (PEFT's
`save_pretrained`); a pickled `adapter_model.bin` is refused like any pickled weights. Each LoRA'd
linear module `W` (out x in) of the base has two tensors, named by the module's path:

    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight   [out, r]

so the safetensors header alone tells the rank and, per target module, the base's feature sizes:
for the tests' tiny Llama (hidden 64, 4 heads of 16, 2 KV heads, intermediate 128) a rank-4 adapter
on q_proj, v_proj and down_proj reads q_proj 64->64, v_proj 64->32 (2 x 16), down_proj 128->64, in
2 layers. That fingerprint, with the base's name, rank, alpha and target modules, is `AdapterInfo`,
recorded in the snapshot's manifest; `base_mismatch` compares it with a base's `config.json`
(Llama-style names: q/k/v/o_proj, gate/up/down_proj, and the fused qkv_proj and gate_up_proj).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from snapshots.durable import open_regular_nofollow
from snapshots.errors import CorruptSnapshot, InvalidSource
from snapshots.weights import pickle_refused, read_header_from

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_PICKLE = "adapter_model.bin"
MAX_RANK = 256  # vLLM's largest max_lora_rank; a larger r is a mistake or not an adapter to serve
MAX_CONFIG_BYTES = 1_000_000

_TENSOR = re.compile(r"(?P<path>(?:[A-Za-z0-9_]+\.)*(?P<module>[A-Za-z0-9_]+))\.lora_(?P<ab>[AB])\.weight")
_LAYER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


@dataclass(frozen=True)
class AdapterInfo:
    """What the store records about a LoRA adapter, and the platform checks against a base."""

    base_model: str | None  # adapter_config.json's base_model_name_or_path, as given
    rank: int  # `r` (the largest rank when rank_pattern varies it)
    lora_alpha: float
    target_modules: tuple[str, ...]  # the module names its tensors adapt, sorted
    shapes: tuple[tuple[str, int, int], ...]  # (module, in_features, out_features), sorted by module
    layers: int  # highest layer index its tensors reach, plus one (0: no numbered layers)
    all_layers: bool  # no layers_to_transform: trained on every layer, so the base has exactly `layers`

    def to_dict(self) -> dict[str, Any]:
        return {
            "base_model": self.base_model,
            "rank": self.rank,
            "lora_alpha": self.lora_alpha,
            "target_modules": list(self.target_modules),
            "fingerprint": {
                "layers": self.layers,
                "all_layers": self.all_layers,
                "modules": {m: {"in": i, "out": o} for m, i, o in self.shapes},
            },
        }

    @classmethod
    def from_dict(cls, doc: object) -> AdapterInfo:
        """Parse the manifest's `adapter` object; CorruptSnapshot if it is not one `to_dict` writes."""
        try:
            record = _dict(doc)
            base, fp = record["base_model"], _dict(record["fingerprint"])
            modules = _dict(fp["modules"])
            if base is not None and not isinstance(base, str):
                raise ValueError(base)
            shapes = tuple(
                sorted((m, _int(_dict(v)["in"]), _int(_dict(v)["out"])) for m, v in modules.items())
            )
            targets = record["target_modules"]
            if not isinstance(targets, list) or targets != sorted(m for m, _, _ in shapes):
                raise ValueError(targets)
            return cls(
                base_model=base,
                rank=_int(record["rank"]),
                lora_alpha=_number(record["lora_alpha"]),
                target_modules=tuple(targets),
                shapes=shapes,
                layers=_int(fp["layers"]),
                all_layers=_bool(fp["all_layers"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptSnapshot("manifest 'adapter' is not a valid adapter record") from exc


def _dict(v: object) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ValueError(v)
    return v


def _int(v: object) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(v)
    return v


def _number(v: object) -> float:
    if not isinstance(v, int | float) or isinstance(v, bool):
        raise ValueError(v)
    return v


def _bool(v: object) -> bool:
    if not isinstance(v, bool):
        raise ValueError(v)
    return v


def is_adapter_dir(src: Path) -> bool:
    """A PEFT adapter rather than a model: `adapter_config.json` and no `config.json` of its own."""
    return (src / ADAPTER_CONFIG).is_file() and not (src / "config.json").exists()


def adapter_info(src: Path) -> AdapterInfo:
    """Read an adapter directory's config and tensor header; InvalidSource (or UnsafeFileError) if unfit.

    Both files are opened without following symlinks (a scan that resolved links passes the targets
    to `read_adapter` instead).
    """
    src = Path(src)
    if not (src / ADAPTER_WEIGHTS).exists() and (src / ADAPTER_PICKLE).exists():
        raise pickle_refused(ADAPTER_PICKLE)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (src / name).exists():
            raise InvalidSource(f"{src} is not a LoRA adapter directory: it has no {name}")
    return read_adapter(src / ADAPTER_CONFIG, src / ADAPTER_WEIGHTS)


def read_adapter(
    config_path: Path, weights_path: Path, expect: Mapping[Path, tuple[int, int]] | None = None
) -> AdapterInfo:
    """`adapter_info` of these two files; `expect`: the (dev, ino) a scan approved for either."""
    expect = expect or {}
    with os.fdopen(open_regular_nofollow(config_path, expect.get(config_path)), "rb") as f:
        raw = f.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:
        raise InvalidSource(f"{ADAPTER_CONFIG} is over {MAX_CONFIG_BYTES} bytes: not an adapter config")
    try:
        config = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidSource(f"{ADAPTER_CONFIG} is not readable JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise InvalidSource(f"{ADAPTER_CONFIG} is not a JSON object")
    r, alpha, base, targets = _check_config(config)
    with os.fdopen(open_regular_nofollow(weights_path, expect.get(weights_path)), "rb") as f:
        tensors = read_header_from(f, Path(ADAPTER_WEIGHTS))
    shapes, layers, top_rank = _fingerprint(tensors, r, varies=bool(config.get("rank_pattern")))
    found = tuple(sorted(shapes))
    if isinstance(targets, list) and not set(found) <= set(targets):
        extra = ", ".join(sorted(set(found) - set(targets)))
        raise InvalidSource(f"{ADAPTER_WEIGHTS} adapts {extra}, which target_modules does not list")
    return AdapterInfo(
        base_model=base,
        rank=top_rank,
        lora_alpha=alpha,
        target_modules=found,
        shapes=tuple((m, *shapes[m]) for m in found),
        layers=layers,
        all_layers=config.get("layers_to_transform") is None,
    )


def _check_config(config: dict[str, Any]) -> tuple[int, float, str | None, object]:
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise InvalidSource(
            f"{ADAPTER_CONFIG} has peft_type {peft_type!r}: only LoRA adapters (peft_type 'LORA') are served"
        )
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or not 1 <= r <= MAX_RANK:
        raise InvalidSource(
            f"{ADAPTER_CONFIG} has rank r={r!r}: it must be a whole number from 1 to {MAX_RANK}"
        )
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise InvalidSource(f"{ADAPTER_CONFIG} has lora_alpha {alpha!r}: it must be a number")
    base = config.get("base_model_name_or_path")
    if base is not None and not isinstance(base, str):
        raise InvalidSource(f"{ADAPTER_CONFIG} has base_model_name_or_path {base!r}: it must be a string")
    targets = config.get("target_modules")
    if isinstance(targets, list) and not all(isinstance(t, str) for t in targets):
        raise InvalidSource(f"{ADAPTER_CONFIG} has target_modules {targets!r}: a list of module names")
    return r, alpha, base, targets


def _fingerprint(
    tensors: Mapping[str, dict], r: int, *, varies: bool
) -> tuple[dict[str, tuple[int, int]], int, int]:
    """Per module name, (in, out); the layer count; the largest rank. InvalidSource on anything else."""
    pairs: dict[str, dict[str, list[int]]] = {}
    for name, entry in tensors.items():
        m = _TENSOR.fullmatch(name)
        if m is None:
            raise InvalidSource(
                f"{ADAPTER_WEIGHTS} holds {name!r}, which is not a LoRA A or B weight of a module "
                "(modules_to_save, DoRA and embedding adapters are not served)"
            )
        shape = entry["shape"]
        if len(shape) != 2:
            raise InvalidSource(f"{ADAPTER_WEIGHTS}: {name} has shape {shape}, not a matrix")
        pairs.setdefault(m["path"], {})[m["ab"]] = shape
    if not pairs:
        raise InvalidSource(f"{ADAPTER_WEIGHTS} holds no LoRA weights")
    shapes: dict[str, tuple[int, int]] = {}
    layers, top = 0, 0
    for path, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            missing = "B" if "A" in ab else "A"
            raise InvalidSource(f"{ADAPTER_WEIGHTS} has no lora_{missing} for {path}")
        (rank_a, fan_in), (fan_out, rank_b) = ab["A"], ab["B"]
        if rank_a != rank_b or rank_a > MAX_RANK or (not varies and rank_a != r) or rank_a < 1:
            raise InvalidSource(
                f"{ADAPTER_WEIGHTS}: {path} has lora_A {ab['A']} and lora_B {ab['B']}, "
                f"inconsistent with rank r={r} (A is [r, in], B is [out, r])"
            )
        top = max(top, rank_a)
        module = path.rsplit(".", 1)[-1]
        if shapes.setdefault(module, (fan_in, fan_out)) != (fan_in, fan_out):
            raise InvalidSource(
                f"{ADAPTER_WEIGHTS}: {module} is {shapes[module][0]}->{shapes[module][1]} in one layer "
                f"and {fan_in}->{fan_out} at {path}"
            )
        if (layer := _LAYER.search(path)) is not None:
            layers = max(layers, int(layer[1]) + 1)
    return shapes, layers, top


# --- against a base --------------------------------------------------------------------------------


def base_shapes(config: Mapping[str, Any]) -> tuple[dict[str, tuple[int, int]], int]:
    """The (in, out) of each Llama-style projection a base's config.json implies, and its layer count.

    Keys absent from the config leave out the modules that need them (an adapter on such a module
    then does not fit). Multimodal configs keep the language model's under `text_config`.
    """
    if "hidden_size" not in config and isinstance(config.get("text_config"), Mapping):
        config = config["text_config"]

    def get(key: str) -> int | None:
        v = config.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    hidden, heads, inter = get("hidden_size"), get("num_attention_heads"), get("intermediate_size")
    kv = get("num_key_value_heads") or heads
    head_dim = get("head_dim") or (hidden // heads if hidden and heads else None)
    out: dict[str, tuple[int, int]] = {}
    if hidden and heads and head_dim and kv:
        q, k = heads * head_dim, kv * head_dim
        out |= {"q_proj": (hidden, q), "k_proj": (hidden, k), "v_proj": (hidden, k), "o_proj": (q, hidden)}
        out["qkv_proj"] = (hidden, q + 2 * k)
    if hidden and inter:
        out |= {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
        out["gate_up_proj"] = (hidden, 2 * inter)
    return out, get("num_hidden_layers") or 0


def base_mismatch(info: AdapterInfo, base_config: Mapping[str, Any], base: str | None = None) -> str | None:
    """None when the base fits every target module's shapes and the layer count; else why not.

    `base` names the base in the message (a snapshot name or id); by default its config's
    `_name_or_path`. The message names the adapter's base_model and shapes and the base's.
    """
    expected, base_layers = base_shapes(base_config)
    base = base or base_config.get("_name_or_path") or "the base model"
    wrong = []
    for module, fan_in, fan_out in info.shapes:
        want = expected.get(module)
        if want is None:
            wrong.append(f"{module} {fan_in}->{fan_out} (the base's config implies no {module})")
        elif want != (fan_in, fan_out):
            wrong.append(f"{module} {fan_in}->{fan_out} (the base's is {want[0]}->{want[1]})")
    if info.layers and info.all_layers and info.layers != base_layers:
        wrong.append(f"{info.layers} layers (the base has {base_layers})")
    elif info.layers > base_layers:
        wrong.append(f"layers up to {info.layers} (the base has {base_layers})")
    if not wrong:
        return None
    return f"the adapter for {info.base_model or '(no base named)'} does not fit {base}: it has " + "; ".join(
        wrong
    )
