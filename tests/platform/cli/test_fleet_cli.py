"""`stoker simulate --fleet FILE` as a user runs it: the real CLI in a subprocess."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from tests.conftest import REPO, STOKER
from tests.deadlines import CLI
from tests.snapshots.support import assert_one_line_error

KEYS = {
    "mode",
    "devices",
    "requests",
    "rejected",
    "slow_cold_starts",
    "wakes",
    "p99_wait_s",
    "device_seconds",
}
FLEET_KEYS = KEYS | {"peak_devices", "deployments"}
DEPLOYMENT_KEYS = {
    "name",
    "requests",
    "rejected",
    "slow_cold_starts",
    "wakes",
    "p99_wait_s",
    "device_seconds",
}

FLEET = """\
devices: 1
device_memory_gb: 40
deployments:
  - name: chat
    trace: trace.csv
    thin: 2
    weights_gb: 16
    kv_gb: 4
  - name: code
    trace: trace.csv
    shift_s: 150
    weights_gb: 16
    policy: keepalive
"""


@pytest.fixture
def fleet(tmp_path):
    rows = "".join(f"{(t // 5) * 60 + t % 5},{200 + t},{10 + t % 5}\n" for t in range(30))  # 6 bursts
    (tmp_path / "trace.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + rows)
    path = tmp_path / "fleet.yaml"
    path.write_text(FLEET)
    return path


def stoker(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([STOKER, "simulate", *args], capture_output=True, text=True, timeout=CLI)


def test_json_lines_for_the_fleet_and_the_dedicated_baseline(fleet):
    out = stoker("--fleet", str(fleet), "--json", "--baseline", "dedicated")
    assert out.returncode == 0, out.stderr
    shared, dedicated = (json.loads(line) for line in out.stdout.splitlines())
    for row in (shared, dedicated):
        assert set(row) == FLEET_KEYS
        assert [d["name"] for d in row["deployments"]] == ["chat", "code"]
        assert all(set(d) == DEPLOYMENT_KEYS for d in row["deployments"])
        assert [d["requests"] for d in row["deployments"]] == [15, 30]
        assert row["requests"] == 45 and row["rejected"] == 0
        assert row["slow_cold_starts"] == sum(d["slow_cold_starts"] for d in row["deployments"])
    assert (shared["mode"], shared["devices"]) == ("shared", 1)
    assert (dedicated["mode"], dedicated["devices"]) == ("dedicated", 2)
    assert dedicated["wakes"] == 0  # kpa never sleeps, and nobody else is on its device
    assert shared["peak_devices"] == 1


def test_a_json_file_and_the_table(fleet, tmp_path):
    import yaml

    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(yaml.safe_load(FLEET)))
    out = stoker("--fleet", str(path))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "shared: 1 device(s) of 40 GB"
    assert lines[1].split()[:3] == ["deployment", "requests", "rejected"]
    assert [line.split()[0] for line in lines[2:5]] == ["chat", "code", "fleet"]


BAD = {
    "devices 0": (("devices: 1", "devices: 0"), ["devices must be a whole number in 1..4096, got 0"]),
    "memory not a number": (("device_memory_gb: 40", "device_memory_gb: lots"), ["device_memory_gb must be"]),
    "unknown field": (("    thin: 2", "    thinn: 2"), ["unknown field deployments[0].thinn"]),
    "thin 0": (("thin: 2", "thin: 0"), ["deployment chat: thin must be a whole number"]),
    "shift not a number": (("shift_s: 150", "shift_s: soon"), ["deployment code: shift_s must be"]),
    "negative kv": (("kv_gb: 4", "kv_gb: -1"), ["deployment chat: kv_gb must be a finite number ≥ 0"]),
    "too big for a device": (
        ("weights_gb: 16\n    kv_gb", "weights_gb: 39\n    kv_gb"),
        ["does not fit a device"],
    ),
    "unknown policy": (("policy: keepalive", "policy: kpq"), ["deployment code: policy must be one of"]),
    "missing trace file": (
        ("trace: trace.csv\n    shift", "trace: nope.csv\n    shift"),
        ["deployment code:", "no such file"],
    ),
    "a name used twice": (("name: code", "name: chat"), ["deployments[1].name 'chat' is used twice"]),
    "missing weights": (
        ("    weights_gb: 16\n    policy", "    policy"),
        ["deployments[1].weights_gb is missing"],
    ),
    "not YAML": (("devices: 1", "devices: [1"), ["not YAML"]),
}


@pytest.mark.parametrize(("edit", "fragments"), BAD.values(), ids=BAD.keys())
def test_a_bad_file_is_one_line_naming_the_file_and_field(fleet, edit, fragments):
    old, new = edit
    assert old in FLEET
    fleet.write_text(FLEET.replace(old, new, 1))
    assert_one_line_error(stoker("--fleet", str(fleet)), f"fleet {fleet}", *fragments)


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--fleet", "/nonexistent/fleet.yaml"], ["fleet /nonexistent/fleet.yaml: no such file"]),
        (["--fleet", "FLEET", "--trace", "x.csv"], ["--fleet takes no --trace"]),
        (["--trace", "x.csv", "--baseline", "dedicated"], ["--baseline needs --fleet FILE"]),
        ([], ["simulate needs --trace FILE or --fleet FILE"]),
    ],
)
def test_bad_flags_are_one_line(fleet, args, fragments):
    args = [str(fleet) if a == "FLEET" else a for a in args]
    assert_one_line_error(stoker(*args), *fragments)


RATIOS = {"quarter": 12, "sixth": 18, "eighth": 24}


@pytest.mark.parametrize(("name", "count"), RATIOS.items())
def test_the_benchmark_fleets_follow_the_rule_their_header_states(name, count):
    """bench/fleets/{quarter,sixth,eighth}.yaml (what `bench/fleet_bench.py` and `stoker simulate
    --fleet` read): the quarter's twelve cycled to `count`, thinned count/12 times more, rotated
    97 s further each time round, on 3 devices of 80 GB that fit two awake instances of either size."""
    quarter = yaml.safe_load((REPO / "bench" / "fleets" / "quarter.yaml").read_text())
    fleet = yaml.safe_load((REPO / "bench" / "fleets" / f"{name}.yaml").read_text())
    assert (fleet["devices"], fleet["device_memory_gb"]) == (3, 80)
    entries = fleet["deployments"]
    assert len(entries) == count == len({e["name"] for e in entries})
    for i, entry in enumerate(entries):
        base, k = quarter["deployments"][i % 12], i // 12
        thin = round(base["thin"] * count / 12)
        assert entry["trace"] == base["trace"]
        assert (entry["weights_gb"], entry["kv_gb"]) == (base["weights_gb"], base["kv_gb"])
        assert entry["thin"] == thin and entry["shift_s"] == (i % 12) * 145 + k * 97
        assert entry["name"] == base["name"].split("-x")[0] + f"-x{thin}" + (f"-{k}" if k else "")
        assert 2 * (entry["weights_gb"] + entry["kv_gb"]) <= fleet["device_memory_gb"]
