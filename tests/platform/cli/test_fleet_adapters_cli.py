"""`stoker simulate --fleet FILE --adapters N --bases B` as a user runs it: adapters on bases against
merged deployments, on a cut of the tests' 29-minute Azure trace."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from tests.conftest import REPO, STOKER
from tests.deadlines import CLI
from tests.snapshots.support import assert_one_line_error

TRACE = REPO / "tests" / "data" / "azure-llm-code-2023-first29min.csv"
CYCLE_SHIFT_S = 97  # the documented rule: each time round the file's deployments, 97 s further
TEMPLATES = [
    {"name": "code-x100", "trace": str(TRACE), "thin": 100, "weights_gb": 16, "kv_gb": 8},
    {"name": "code-x300", "trace": str(TRACE), "thin": 300, "shift_s": 50, "weights_gb": 16, "kv_gb": 8},
]
SIDE_KEYS = {
    "requests",
    "rejected",
    "peak_devices",
    "packed_devices",
    "device_seconds",
    "slow_cold_starts",
    "slow_cold_starts_per_1k",
    "p99_wait_s",
    "adapter_loads",
    "prefetched",
    "paid_loads",
}


def stoker(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([STOKER, "simulate", *args], capture_output=True, text=True, timeout=CLI)


def write(path, deployments: list[dict]):
    path.write_text(yaml.safe_dump({"devices": 4, "device_memory_gb": 80, "deployments": deployments}))
    return path


def test_adapters_on_two_bases_against_the_same_requests_as_merged_deployments(tmp_path):
    out = stoker(
        "--fleet", str(write(tmp_path / "t.yaml", TEMPLATES)), "--adapters", "12", "--bases", "2", "--json"
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    # The merged side is the plain fleet mode over the same 12 deployments, written out by the rule.
    twelve = []
    for i in range(12):
        t, k = TEMPLATES[i % 2], i // 2
        twelve.append(
            {
                **t,
                "name": t["name"] + (f"-{k}" if k else ""),
                "shift_s": t.get("shift_s", 0) + k * CYCLE_SHIFT_S,
            }
        )
    plain = stoker("--fleet", str(write(tmp_path / "twelve.yaml", twelve)), "--json")
    assert plain.returncode == 0, plain.stderr
    assert got["merged"] == json.loads(plain.stdout)
    names = [d["name"] for d in got["merged"]["deployments"]]
    assert names[:4] == ["code-x100", "code-x300", "code-x100-1", "code-x300-1"] and len(names) == 12

    merged, adapters = got["side_by_side"]["merged"], got["side_by_side"]["adapters"]
    assert set(merged) == set(adapters) == SIDE_KEYS
    assert (got["adapters"], got["bases"], got["devices"], got["adapter_load_s"]) == (12, 2, 4, 0.25)
    # The same requests on both sides, adapter by adapter.
    rows = got["on_bases"]["adapters"]
    assert [r["name"] for r in rows] == names
    assert [r["requests"] for r in rows] == [d["requests"] for d in got["merged"]["deployments"]]
    assert [r["base"] for r in rows] == ["base-0", "base-1"] * 6
    assert [d["name"] for d in got["on_bases"]["deployments"]] == ["base-0", "base-1"]
    assert adapters["requests"] == merged["requests"] == sum(r["requests"] for r in rows)
    assert merged["slow_cold_starts"] == got["merged"]["slow_cold_starts"]
    assert merged["peak_devices"] == got["merged"]["peak_devices"]
    assert (merged["adapter_loads"], merged["paid_loads"]) == (0, 0)
    assert adapters["adapter_loads"] == sum(r["adapter_loads"] for r in rows) > 0
    assert adapters["slow_cold_starts"] == sum(r["slow_cold_starts"] for r in rows)
    # Two bases warm for twelve adapters' traffic: fewer slow cold starts than twelve models.
    assert adapters["slow_cold_starts"] < merged["slow_cold_starts"]


def test_the_side_by_side_table(tmp_path):
    fleet = write(tmp_path / "t.yaml", TEMPLATES[1:])
    out = stoker("--fleet", str(fleet), "--adapters", "2", "--max-adapters", "1", "--adapter-load-s", "0.5")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("2 adapters on 1 base(s) against 2 merged deployments, on 4 shared device(s)")
    assert "max_adapters 1, adapter load 0.5 s" in lines[0]
    assert lines[1].split() == ["merged", "adapters"]
    assert [line.rsplit(maxsplit=2)[0] for line in lines[2:4]] == ["requests", "rejected"]


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--fleet", "FLEET", "--bases", "2"], ["--bases needs --adapters N"]),
        (["--trace", "x.csv", "--adapters", "3"], ["--adapters needs --fleet FILE"]),
        (["--fleet", "FLEET", "--adapters", "2", "--bases", "3"], ["--bases 3 is more than --adapters 2"]),
        (["--fleet", "FLEET", "--adapters", "0"], ["--adapters must be a whole number in 1..100000, got 0"]),
        (["--fleet", "FLEET", "--adapters", "2", "--max-adapters", "0"], ["--max-adapters must be"]),
        (["--fleet", "FLEET", "--adapters", "2", "--adapter-load-s", "-1"], ["adapter_load_s must be ≥ 0 s"]),
        (
            ["--fleet", "FLEET", "--adapters", "2", "--baseline", "dedicated"],
            ["--adapters takes no --baseline"],
        ),
    ],
)
def test_bad_adapter_flags_are_one_line(tmp_path, args, fragments):
    fleet = str(write(tmp_path / "t.yaml", TEMPLATES[1:]))
    assert_one_line_error(stoker(*[fleet if a == "FLEET" else a for a in args]), *fragments)
