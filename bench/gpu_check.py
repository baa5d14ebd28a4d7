"""The engine on a GPU, in one run: start to first token from disk and from page cache, sleep and
wake, and the ceilings they are held to, for a Llama-3-8B-shaped model.

On a machine with an NVIDIA GPU, from the repository root (needs torch, transformers and
safetensors only; nothing is downloaded, accelerate is not needed):

    python bench/gpu_check.py --tiny                        # the same steps on a tiny model: seconds
    python bench/gpu_check.py --out gpu_check.json          # Llama-3-8B shape, bf16

The tiny run first is a cheap smoke test of the GPU path. The 8B run should take a few minutes
(an estimate: it has not run on a GPU yet); a child still running `BUDGET_S` after the start is cut
and reported under `errors`, so the whole run stays inside 8 minutes. Exit status 0 when every step
ran (targets met or not, see `meets`), 1 when one failed.

`--dir` holds the snapshot (default /tmp/stoker-gpu-check[-tiny]; 16 GB for the 8B shape, kept and
reused by the next run). Run it as root so the cold measurements can drop the whole page cache
(`echo 3 > /proc/sys/vm/drop_caches`, which also makes the imports cold); otherwise only the
snapshot's own files are dropped (`POSIX_FADV_DONTNEED`) and `cache_drop` says so. Check
`filesystem` in the output: on tmpfs the "disk" is memory. `--tiny` never drops the machine's whole
cache (it runs inside the test suite, next to other work); `--tiny --device cpu` runs anywhere.

What it does:
1. writes a random-weight snapshot of Llama-3-8B's shape (hidden 4096, 32 layers, 32 heads, 8 KV
   heads, intermediate 14336, vocab 128256; 16 GB of bf16 in 4 safetensors shards), generated on
   the GPU; no tokenizer: the checks feed token ids;
2. the ceilings: a cold `dd` of the shards (disk), a second `dd` (page cache), and in the sleep
   child the pinned host-to-device copy of as many bytes as the weights;
3. in a fresh process each: process start to first token with the snapshot cold (page cache
   dropped), then warm. The load is the engine's own (`stoker.engine.weights.load_model`: model
   built with no weights, safetensors memory-mapped and copied to the device); the first token is
   one forward pass over 16 token ids. `interpreter_s` is the spawn to the script's first line;
4. in the warm process, after its first token: sleep level 1 (`weights.put_to_sleep`: weights to
   pinned host memory, device memory freed), wake (`weights.wake`), first token again, which must
   be the same token; then the engine's load against safetensors' own `device=` load, both from the
   page cache (the choice `weights._Staging` makes).

It prints one JSON object (and writes it to `--out`): seconds, GB/s (10^9 bytes), `wake_over_h2d`
(wake time over the pinned copy of the same bytes) and the targets: an 8B start within 3 s of
first token, a wake within 20 % of the copy limit.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
from pathlib import Path

from common import REPO, dd_read, drop_page_cache, ratio, rnd, say

LLAMA3_8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
TINY = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
SHARDS = 4
PROMPT = list(range(1000, 1016))  # 16 token ids, inside both vocabularies
TARGETS = {"start_to_first_token_s": 3.0, "wake_over_h2d": 1.2}
BUDGET_S = 450  # the whole run fits 8 minutes with room to spare; a child that hangs is cut here
H2D_REPEATS = 3


def main() -> int:
    args = parse_args()
    if args.child:
        return child(args)
    started = time.monotonic()
    shape, dtype = (TINY, "float32") if args.tiny else (LLAMA3_8B, "bfloat16")
    snapshot = Path(args.dir or f"/tmp/stoker-gpu-check{'-tiny' if args.tiny else ''}")
    files, write_s = write_snapshot(snapshot, shape, dtype)
    size = sum(f.stat().st_size for f in files)
    result: dict = {
        "shape": "tiny" if args.tiny else "llama-3-8b",
        "dtype": dtype,
        "dir": str(snapshot),
        "filesystem": filesystem(snapshot),
        "shards": len(files),
        "weight_bytes": size,
        "write_s": write_s,  # None: the snapshot from an earlier run was reused
        "targets": TARGETS,
        "errors": [],
    }

    say("ceilings: dd of the shards, cold then from page cache")
    result["cache_drop"] = drop(files, machine_wide=not args.tiny)
    cold = [dd_read(f) for f in files]
    warm = [dd_read(f) for f in files]
    result["ceilings"] = {
        "disk_read_s": sum(r["seconds"] for r in cold),
        "disk_read_gbps": gbps(size, sum(r["seconds"] for r in cold)),
        "page_cache_read_gbps": gbps(size, sum(r["seconds"] for r in warm)),
    }

    say("start to first token, snapshot cold")
    drop(files, machine_wide=not args.tiny)
    cold_start = run_child("start", args, snapshot, dtype, deadline=started + BUDGET_S)
    say("start to first token from page cache, then sleep level 1 and wake")
    for f in files:
        dd_read(f)  # the cold child mapped every page, but make sure: this is the page-cache tier
    warm_start = run_child("start-sleep", args, snapshot, dtype, deadline=started + BUDGET_S)
    for name, run in (("start_from_disk", cold_start), ("start_from_page_cache", warm_start)):
        if "error" in run:
            result["errors"].append(f"{name}: {run['error']}")
        result["errors"] += run.get("errors", [])
    result["device"] = warm_start.get("device") or cold_start.get("device")
    result["gpu"] = warm_start.get("gpu")
    result["versions"] = warm_start.get("versions")
    result["start_from_disk"] = cold_start.get("start")
    result["start_from_page_cache"] = warm_start.get("start")
    result["sleep_wake"] = warm_start.get("sleep_wake")
    result["load_from_page_cache"] = warm_start.get("load_from_page_cache")
    result["modules"] = warm_start.get("modules")
    h2d = warm_start.get("h2d") or {}
    result["ceilings"].update(h2d_pinned_s=h2d.get("seconds"), h2d_pinned_gbps=h2d.get("gbps"))
    wake_s = (result["sleep_wake"] or {}).get("wake_s")
    result["wake_over_h2d"] = ratio(wake_s, h2d.get("seconds"))
    result["meets"] = meets(result, applies=not args.tiny and result["device"] == "cuda")
    result["elapsed_s"] = time.monotonic() - started

    text = json.dumps(rnd(result), indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 1 if result["errors"] else 0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", help="where the snapshot is written (default /tmp/stoker-gpu-check[-tiny])")
    p.add_argument("--out", help="also write the JSON object to this file")
    p.add_argument("--tiny", action="store_true", help="2 layers, hidden 256, fp32: seconds, on any machine")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="as `stoker engine`")
    p.add_argument("--child", choices=["start", "start-sleep"], help=argparse.SUPPRESS)
    p.add_argument("--dtype", help=argparse.SUPPRESS)
    p.add_argument("--t0", type=float, help=argparse.SUPPRESS)  # the parent's monotonic clock at spawn
    return p.parse_args()


# ---- the snapshot ------------------------------------------------------------------------------------


def llama_tensors(shape: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a LlamaForCausalLM with untied embeddings, by the names transformers gives them."""
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    head = h // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * head, shape["num_key_value_heads"] * head
    out = [("model.embed_tokens.weight", (v, h))]
    for n in range(shape["num_hidden_layers"]):
        layer = f"model.layers.{n}"
        out += [
            (f"{layer}.input_layernorm.weight", (h,)),
            (f"{layer}.self_attn.q_proj.weight", (q, h)),
            (f"{layer}.self_attn.k_proj.weight", (kv, h)),
            (f"{layer}.self_attn.v_proj.weight", (kv, h)),
            (f"{layer}.self_attn.o_proj.weight", (h, q)),
            (f"{layer}.post_attention_layernorm.weight", (h,)),
            (f"{layer}.mlp.gate_proj.weight", (i, h)),
            (f"{layer}.mlp.up_proj.weight", (i, h)),
            (f"{layer}.mlp.down_proj.weight", (h, i)),
        ]
    return [*out, ("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def llama_config(shape: dict, dtype: str) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "head_dim": shape["hidden_size"] // shape["num_attention_heads"],
        "rms_norm_eps": 1e-5,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "dtype": dtype,
        **shape,
    }


def write_snapshot(snapshot: Path, shape: dict, dtype: str) -> tuple[list[Path], float | None]:
    """The shards of a random-weight model of `shape`, written and synced; reused when already there."""
    import torch
    from safetensors.torch import save_file

    config = llama_config(shape, dtype)
    marker = snapshot / "gpu_check.json"
    names = [f"model-{n + 1:05d}-of-{SHARDS:05d}.safetensors" for n in range(SHARDS)]
    if marker.is_file() and json.loads(marker.read_text()) == config:
        say(f"reusing the snapshot in {snapshot}")
        return [snapshot / name for name in names], None

    t0 = time.monotonic()
    snapshot.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    (snapshot / "config.json").write_text(json.dumps(config, indent=2))
    tensors = llama_tensors(shape)
    element = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    total = sum(element * prod(s) for _, s in tensors)
    # Random numbers come fastest from the GPU (16 GB in well under a second); then one shard at a time
    # goes to host memory and disk.
    source = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=source).manual_seed(0)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[] for _ in range(SHARDS)]
    done = 0
    for name, s in tensors:  # contiguous runs, about total / SHARDS bytes each
        shards[min(SHARDS - 1, done * SHARDS // total)].append((name, s))
        done += element * prod(s)
    weight_map = {}
    for path_name, shard in zip(names, shards, strict=True):
        say(f"writing {path_name} ({len(shard)} tensors)")
        out = {}
        for name, s in shard:
            if name.endswith("norm.weight"):
                t = torch.ones(s, dtype=getattr(torch, dtype), device=source)
            else:  # Llama's own initialiser scale: activations stay finite through 32 layers
                t = torch.randn(s, dtype=getattr(torch, dtype), device=source, generator=gen).mul_(0.02)
            out[name] = t.cpu()
            weight_map[name] = path_name
        path = snapshot / path_name
        save_file(out, path, metadata={"format": "pt"})
        with path.open("rb+") as f:
            os.fsync(f.fileno())  # a dirty page cannot be dropped: the cold figures need it on disk
        del out
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (snapshot / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    marker.write_text(json.dumps(config))
    return [snapshot / name for name in names], time.monotonic() - t0


def prod(xs) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


# ---- the machine -------------------------------------------------------------------------------------


def drop(files: list[Path], *, machine_wide: bool) -> dict:
    """Drop the shards from the page cache: the whole cache when allowed and wanted, else each file."""
    if machine_wide:
        methods = {drop_page_cache(f) for f in files}  # bench/common.py: drop_caches, else fadvise
        if methods == {"drop_caches"}:
            return {"method": "drop_caches", "machine_wide": True}
        return {
            "method": "posix_fadvise_dontneed",
            "machine_wide": False,
            "note": "could not write /proc/sys/vm/drop_caches (not root?): only the shards were dropped",
        }
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return {
        "method": "posix_fadvise_dontneed",
        "machine_wide": False,
        "note": "--tiny drops its own files only",
    }


def filesystem(path: Path) -> str | None:
    """The type of the filesystem `path` lies on, from /proc/mounts (the longest matching mount point)."""
    real, best = os.path.realpath(path), ("", None)
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            _, point, kind, *_ = line.split()
            if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) > len(best[0]):
                best = (point, kind)
    return best[1]


def gbps(nbytes: int, seconds: float | None) -> float | None:
    return nbytes / seconds / 1e9 if seconds else None


def meets(result: dict, *, applies: bool) -> dict | None:
    """Each target met or not; None where the run is not the 8B shape on a GPU, which they are for."""
    if not applies:
        return None
    limit = TARGETS["start_to_first_token_s"]

    def start_ok(name: str) -> bool | None:
        run = result.get(name) or {}
        return run["to_first_token_s"] <= limit if "to_first_token_s" in run else None

    wake = result.get("wake_over_h2d")
    return {
        "start_from_page_cache": start_ok("start_from_page_cache"),
        "start_from_disk": start_ok("start_from_disk"),
        "wake": wake <= TARGETS["wake_over_h2d"] if wake is not None else None,
    }


def run_child(kind: str, args: argparse.Namespace, snapshot: Path, dtype: str, deadline: float) -> dict:
    import subprocess

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    base = [sys.executable, __file__, "--child", kind, "--dir", str(snapshot), "--device", args.device]
    timeout = max(30.0, deadline - time.monotonic())
    t0 = time.monotonic()
    try:
        out = subprocess.run(
            [*base, "--dtype", dtype, "--t0", repr(t0)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"no answer within {timeout:.0f} s"}
    if out.returncode != 0:
        return {"error": f"exit {out.returncode}: {out.stderr.strip()[-2000:]}"}
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"error": f"no JSON line on stdout: {out.stdout[-500:]!r} {out.stderr.strip()[-1500:]}"}


# ---- in the child process ----------------------------------------------------------------------------


def child(args: argparse.Namespace) -> int:
    t_main = time.monotonic()
    sys.path.insert(0, str(REPO / "platform"))
    import torch

    from stoker.engine import weights  # needs torch, transformers and safetensors only

    try:
        device = weights.choose_device(args.device, torch.cuda.is_available())
    except ValueError as exc:
        sys.exit(str(exc))
    t_imports = time.monotonic()
    cuda = device == "cuda"
    if cuda:
        torch.empty(1, device=device)  # the CUDA context: part of any start, timed on its own
        torch.cuda.synchronize()
    t_device = time.monotonic()
    snapshot, dtype = Path(args.dir), getattr(torch, args.dtype)
    model, source = weights.load_model(snapshot, dtype, device)
    t_load = time.monotonic()
    token = first_token(model, device)
    t_first = time.monotonic()
    size = sum(f.stat().st_size for f in snapshot.glob("*.safetensors"))
    out: dict = {
        "device": device,
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "versions": versions(),
        "start": {
            "to_first_token_s": t_first - args.t0,
            "interpreter_s": t_main - args.t0,
            "imports_s": t_imports - t_main,
            "device_init_s": t_device - t_imports,
            "load_s": t_load - t_device,
            "load_gbps": gbps(size, t_load - t_device),
            "first_token_s": t_first - t_load,
            "weights_source": source,
        },
    }
    if args.child == "start-sleep":
        # Each step on its own: a failure is reported with the figures already taken, not instead of them.
        with step(out, "sleep_wake"):
            out["sleep_wake"] = sleep_and_wake(model, snapshot, device, token)
        nbytes = sum(p.nbytes for p in model.parameters())
        del model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            with step(out, "h2d"):
                out["h2d"] = h2d_copy(nbytes, device)
            with step(out, "load_from_page_cache"):
                out["load_from_page_cache"] = compare_loads(snapshot, dtype, device, size)
    out["modules"] = loaded_modules()
    print(json.dumps(out))
    return 0


@contextlib.contextmanager
def step(out: dict, name: str):
    try:
        yield
    except Exception as exc:
        out.setdefault("errors", []).append(f"{name}: {exc!r}")


def first_token(model, device: str) -> int:
    import torch

    ids = torch.tensor([PROMPT], device=device)
    with torch.inference_mode():
        logits = model(input_ids=ids, use_cache=False).logits
    return int(logits[0, -1].argmax())  # int() waits for the device


def sleep_and_wake(model, snapshot: Path, device: str, token: int) -> dict:
    """Level 1 as the engine does it (`weights.put_to_sleep`, `weights.wake`), then the first token."""
    from stoker.engine import weights

    plan = weights.sleep_plan(1, device)
    nbytes = sum(p.nbytes for p in model.parameters())  # each tied parameter once
    awake = memory_in_use(device)
    t0 = time.monotonic()
    weights.put_to_sleep(model, plan)
    t1 = time.monotonic()
    asleep = memory_in_use(device)
    if reason := weights.wake(model, plan, snapshot, device):
        raise RuntimeError(f"wake: {reason}")
    t2 = time.monotonic()
    again = first_token(model, device)
    t3 = time.monotonic()
    weights.release_pinned()
    t4 = time.monotonic()
    return {
        "level": 1,
        "weights_to_pinned_host": plan.to_host,
        "weight_bytes": nbytes,
        "sleep_s": t1 - t0,
        "wake_s": t2 - t1,
        "wake_gbps": gbps(nbytes, t2 - t1),
        "wake_to_first_token_s": t3 - t1,
        "release_pinned_s": t4 - t3,
        "same_token": again == token,
        "memory_kind": "cuda_reserved" if device == "cuda" else "process_rss",
        "memory_awake_bytes": awake,
        "memory_asleep_bytes": asleep,
    }


def h2d_copy(nbytes: int, device: str) -> dict:
    """The link's limit: the best of a few copies of `nbytes` from one pinned buffer to the device."""
    import torch

    from stoker.engine import weights

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(H2D_REPEATS):
        torch.cuda.synchronize()
        t0 = time.monotonic()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.monotonic() - t0)
    del src, dst
    weights.release_pinned()
    torch.cuda.empty_cache()
    return {"bytes": nbytes, "seconds": best, "gbps": gbps(nbytes, best)}


def compare_loads(snapshot: Path, dtype, device: str, size: int) -> dict:
    """The engine's copy to the device (`assign_weights`) against safetensors' `device=`, page cache warm."""
    import torch
    from safetensors.torch import load_file

    from stoker.engine import weights

    files = sorted(snapshot.glob("*.safetensors"))
    target = f"cuda:{torch.cuda.current_device()}"
    torch.cuda.synchronize()
    t0 = time.monotonic()
    loaded = [load_file(f, device=target) for f in files]
    torch.cuda.synchronize()
    safetensors_s = time.monotonic() - t0
    del loaded
    torch.cuda.empty_cache()
    model = weights.empty_model(snapshot, dtype, device)
    t0 = time.monotonic()
    if reason := weights.assign_weights(model, snapshot, device):
        raise RuntimeError(f"assign_weights: {reason}")
    engine_s = time.monotonic() - t0
    return {
        "engine_s": engine_s,
        "engine_gbps": gbps(size, engine_s),
        "safetensors_device_s": safetensors_s,
        "safetensors_device_gbps": gbps(size, safetensors_s),
    }


def memory_in_use(device: str) -> int:
    import torch

    if device == "cuda":
        return torch.cuda.memory_reserved()
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def versions() -> dict:
    from importlib import metadata

    out = {}
    for dist in ("torch", "transformers", "safetensors", "accelerate"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def loaded_modules() -> list[str]:
    """Top-level packages imported, outside the standard library: what this check needed."""
    tops = {name.partition(".")[0] for name in sys.modules if not name.startswith("_")}
    ours = {name for name in sys.modules if name.partition(".")[0] == "stoker"}
    return sorted((tops - set(sys.stdlib_module_names) - {"stoker"}) | ours)


if __name__ == "__main__":
    sys.exit(main())
