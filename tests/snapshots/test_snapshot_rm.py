"""`stoker snapshot rm`: removes a snapshot no one uses; refuses, in one line, one that a deployment
serves (even at zero instances, when nothing pins it) or that a process has pinned."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from snapshots import SnapshotStore
from stoker.control.registry import Registry
from stoker.spec.deployment import DeploymentSpec
from tests.snapshots.support import RunCLI, assert_one_line_error


def imported(cli: RunCLI, model: Path, name: str) -> str:
    proc = cli("import", str(model), "--name", name, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["id"]


def listed(cli: RunCLI) -> list[str]:
    return [e["id"] for e in json.loads(cli("ls", "--json").stdout)]


def test_rm_removes_what_nobody_uses_and_refuses_what_is_in_use(
    cli: RunCLI, home_env: dict[str, str], store: SnapshotStore, tiny_model_dir: Path
) -> None:
    snapshot_id = imported(cli, tiny_model_dir, "tiny")

    # A deployment serves it: refused, though no instance runs and nothing pins it.
    registry = Registry(Path(home_env["STOKER_HOME"]) / "stoker.db")
    asyncio.run(registry.put(DeploymentSpec(name="chat", model="tiny", snapshot_id=snapshot_id)))
    assert_one_line_error(
        cli("rm", "tiny"), f"snapshot {snapshot_id[:12]} is used by deployment chat", "stoker rm chat"
    )
    asyncio.run(registry.delete("chat"))
    registry.close()

    # Pinned (an engine holds it): refused, naming the holder.
    with store.pin(snapshot_id, "engine pid 4242"):
        assert_one_line_error(
            cli("rm", snapshot_id[:12]), "is in use (pinned by engine pid 4242)", "not removed"
        )
    assert listed(cli) == [snapshot_id]

    done = cli("rm", "tiny")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"removed {snapshot_id[:12]} (tiny), ")
    assert listed(cli) == [] and not store.path_of(snapshot_id).exists()
    assert_one_line_error(cli("rm", "tiny"), "no snapshot matches 'tiny'")
