"""The package's names load on first use: each one resolves, and the light parts (balance modes,
config, errors) import without the proxy and aiohttp, so the CLI's checks stay quick."""

from __future__ import annotations

import subprocess
import sys

import activator


def test_every_exported_name_resolves_to_its_module() -> None:
    assert sorted(activator.__all__) == sorted(activator._WHERE)
    for name in activator.__all__:
        assert getattr(activator, name).__module__ == activator._WHERE[name]


def test_the_light_parts_import_without_the_proxy() -> None:
    code = (
        "import sys; from activator.affinity import Balance; from activator import ActivatorConfig, QueueFull; "
        "assert 'aiohttp' not in sys.modules and 'activator.activator' not in sys.modules, sorted(sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
