"""The live path does not load the simulator: the start-up priors come from `warm_pool.profiles`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.deadlines import deadline


@pytest.mark.parametrize(
    "module", ["stoker.control.platform", "warm_pool.pool", "warm_pool.policies.settings"]
)
def test_live_path_does_not_import_the_simulator(module: str) -> None:
    code = f"import sys, {module}; assert 'warm_pool.simulate' not in sys.modules, sorted(sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=deadline(120)
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_simulator_and_live_settings_share_one_profile() -> None:
    from warm_pool import profiles, simulate
    from warm_pool.policies.settings import startup_priors

    assert simulate.GPU is profiles.GPU
    assert startup_priors("cpu") == profiles.CPU.startup
    assert startup_priors("vllm-cpu") == profiles.VLLM_CPU.startup
