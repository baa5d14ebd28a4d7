"""Converting the embedded GGUF (SmolLM2, 98 MB, Q4_1) to a float32 snapshot, side by side, in one run.

    python bench/gguf_bench.py [--rounds 2] [--out bench/results/gguf.json]

Two ways, alternated round by round, each a fresh Python process (imports included, as in
`stoker snapshot import`): transformers' own GGUF path as it comes (`baseline`: it parses the file's
metadata three times and rebuilds gguf's tensor-name table for every module), and
`snapshots.gguf_convert.convert_gguf` as shipped (`one_parse`: one reader per file, the name table
memoized). Both write their snapshot; the bench checks the two wrote the same tensors, then prints
the medians, the ratio and the CPU seconds, and writes every sample as JSON.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, fmt_s, fmt_x, machine_info, med, ratio, say, write_results

CHILD = """
import contextlib, hashlib, json, sys
from pathlib import Path
from snapshots import builtin_path
from snapshots import gguf_convert
if sys.argv[1] == "baseline":
    gguf_convert._one_parse = contextlib.nullcontext
out = Path(sys.argv[2])
gguf_convert.convert_gguf(builtin_path("smollm2"), out)
from safetensors import safe_open
digest = hashlib.sha256()
with safe_open(str(out / "model.safetensors"), "pt") as f:
    for name in sorted(f.keys()):
        digest.update(name.encode() + f.get_tensor(name).numpy().tobytes())
print(json.dumps({"tensors": digest.hexdigest()}))
"""


def convert(way: str, scratch: Path) -> dict:
    out = scratch / way
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", CHILD, way, str(out)], capture_output=True, text=True, timeout=1200, cwd=REPO
    )
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"gguf_bench: {way} failed: {done.stderr.strip().splitlines()[-1:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    subprocess.run(["rm", "-rf", str(out)], check=True)
    return {"wall_s": wall, "cpu_s": cpu, **json.loads(done.stdout.strip().splitlines()[-1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "gguf.json")
    args = ap.parse_args()
    started = time.monotonic()
    info = machine_info(("torch", "transformers", "gguf"))
    samples: dict[str, list[dict]] = {"baseline": [], "one_parse": []}
    with tempfile.TemporaryDirectory(prefix="gguf-bench-") as scratch:
        for r in range(args.rounds):
            order = ("baseline", "one_parse") if r % 2 == 0 else ("one_parse", "baseline")
            for way in order:
                say(f"round {r + 1}/{args.rounds}: {way}")
                samples[way].append(convert(way, Path(scratch)))
                say(f"  {samples[way][-1]['wall_s']:.1f} s")
    digests = {s["tensors"] for way in samples for s in samples[way]}
    if len(digests) != 1:
        raise SystemExit("gguf_bench: the two ways wrote different tensors")
    wall = {way: med([s["wall_s"] for s in xs]) for way, xs in samples.items()}
    cpu = {way: med([s["cpu_s"] for s in xs]) for way, xs in samples.items()}
    results = {
        "kind": "gguf-bench",
        "machine": info,
        "rounds": args.rounds,
        "wall_s": wall,
        "cpu_s": cpu,
        "speedup": ratio(wall["baseline"], wall["one_parse"]),
        "same_tensors": True,
        "samples": samples,
        "elapsed_s": time.monotonic() - started,
    }
    md = "\n".join(
        [
            f"Converting SmolLM2's GGUF, {args.rounds} rounds, medians (load {info['loadavg_start'][0]:.2f}):",
            "",
            "| way | wall | CPU |",
            "|---|---|---|",
            f"| transformers' own path | {fmt_s(wall['baseline'])} | {fmt_s(cpu['baseline'])} |",
            f"| one parse (shipped) | {fmt_s(wall['one_parse'])} | {fmt_s(cpu['one_parse'])} |",
            "",
            f"Speed-up: {fmt_x(results['speedup'])}; both wrote the same tensors.",
        ]
    )
    write_results(args.out, results, md)


if __name__ == "__main__":
    main()
