"""Copy the benchmark tables from bench/results/*.md into the docs' benchmark pages
(docs/benchmarks/*.md), between their `<!-- bench:NAME -->` markers."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    for page in sorted((ROOT / "docs" / "benchmarks").glob("*.md")):
        text = page.read_text()
        for name in (
            "engine",
            "constrained",
            "engines",
            "warm_kv",
            "decode_profile",
            "burst",
            "vllm_start",
            "proxy",
            "s3",
            "scale",
            "policies",
            "adapters",
            "batch",
            "overload",
            "bodies",
            "soak",
        ):
            source = ROOT / "bench" / "results" / f"{name}.md"
            if not source.exists():
                continue
            table = source.read_text().strip()
            pattern = re.compile(rf"(<!-- bench:{name} -->\n).*?(<!-- /bench:{name} -->)", re.S)
            text = pattern.sub(lambda m, t=table: m.group(1) + t + "\n" + m.group(2), text)
        page.write_text(text)


if __name__ == "__main__":
    main()
