"""bench/soak.py with Python's allocations in `stoker up` traced: where its memory grows, if it does.

    SOAK_TM_DIR=DIR python bench/soak_tracemalloc.py [soak.py's options]

The soak runs as usual, but every `stoker` command it starts goes through this file, which for
`stoker up` turns on tracemalloc (16 frames) and, 3 minutes in, takes a base snapshot; then every
2 minutes it writes DIR/diff-NN.txt: the traced total and peak, the 25 lines whose allocations
grew most since the base, and the 8 largest growths by traceback. The snapshots and their
comparison run in a thread of `stoker up` and hold the interpreter for seconds on 2 cores, and
the peak includes their own allocations: an investigation, not a benchmark. Its figures are not
comparable with an untraced run.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import tracemalloc
from pathlib import Path

HERE = Path(__file__).resolve()


def watch(out: Path, first_s: float = 180.0, every_s: float = 120.0) -> None:
    time.sleep(first_s)
    base = tracemalloc.take_snapshot()
    n = 0
    while True:
        time.sleep(every_s)
        n += 1
        snap = tracemalloc.take_snapshot()
        cur, peak = tracemalloc.get_traced_memory()
        with (out / f"diff-{n:02d}.txt").open("w") as f:
            f.write(f"traced {cur / 2**20:.2f} MiB (peak {peak / 2**20:.2f})\n")
            for kind, top in (("lineno", 25), ("traceback", 8)):
                f.write(f"== by {kind}\n")
                for s in snap.compare_to(base, kind)[:top]:
                    f.write(f"{s.size_diff / 1024:+.1f} KiB {s.count_diff:+d} blocks: {s}\n")
                    if kind == "traceback":
                        f.write("\n".join("    " + line for line in s.traceback.format()[-12:]) + "\n")


def stoker(args: list[str]) -> int:
    from stoker.cli.main import main

    if args[:1] == ["up"]:
        out = Path(os.environ["SOAK_TM_DIR"])
        out.mkdir(parents=True, exist_ok=True)
        tracemalloc.start(16)
        threading.Thread(target=watch, args=(out,), daemon=True).start()
    return main(args)


if __name__ == "__main__":
    if sys.argv[1:2] == ["stoker"]:
        sys.exit(stoker(sys.argv[2:]))
    if "SOAK_TM_DIR" not in os.environ:
        sys.exit("soak_tracemalloc: set SOAK_TM_DIR to the directory for the diffs")
    sys.path.insert(0, str(HERE.parent))
    import soak

    soak.stoker_command = lambda: [sys.executable, str(HERE), "stoker"]
    sys.exit(soak.main())
