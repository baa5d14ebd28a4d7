"""The data plane stays small: a `stoker gateway` process, started for real, imports no pool, no
lifecycle, no instance backend and no module of `stoker.control`, and the `stoker.gateway` package imports nothing of the control
plane, the admin API, the process shapes or the CLI (imports point down only)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.snapshots.s3_support import free_port

PACKAGE = Path(__file__).resolve().parents[3] / "platform" / "stoker"

# What a gateway must never load: the live pool, its lifecycle, and every way of starting an instance.
CONTROL_ONLY = (
    "warm_pool.pool",
    "warm_pool.lifecycle",
    "warm_pool.backends",
    "warm_pool.backends.local",
    "warm_pool.backends.kube",
    "warm_pool.instances",
    "warm_pool.launch",
    "stoker.control",  # nothing of the control plane at all
)

# A real `stoker gateway`: once its app is built and serving, it writes what it imported and exits.
PROBE = """
import json, os, sys, threading
def dump():
    ours = sorted(m for m in sys.modules if m.split(".")[0] in ("stoker", "warm_pool", "activator", "snapshots"))
    with open(os.environ["DUMP"], "w") as f:
        json.dump(ours, f)
    os._exit(0)
import uvicorn
serve = uvicorn.Server.serve
async def serving(self, *args, **kwargs):
    threading.Timer(0, dump).start()  # the app is built; its lifespan has started
    return await serve(self, *args, **kwargs)
uvicorn.Server.serve = serving
from stoker.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_gateway_process_imports_no_pool_lifecycle_or_backend(tmp_path: Path) -> None:
    dump = tmp_path / "modules.json"
    env = {**os.environ, "DUMP": str(dump), "STOKER_ADMIN_KEY": "sk-test-admin-0123456789abcdef"}
    argv = ["gateway", "--controller", "http://127.0.0.1:9", "--port", str(free_port())]
    argv += ["--data-dir", str(tmp_path / "data")]
    result = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], env=env, capture_output=True, text=True, timeout=120
    )
    assert dump.exists(), f"the gateway did not start: {result.stderr[-2000:]}"
    modules = json.loads(dump.read_text())
    assert "stoker.serve.gateway" in modules and "stoker.gateway.plane" in modules
    loaded = [m for m in modules if m.startswith(CONTROL_ONLY)]
    assert loaded == [], f"a gateway loaded the control plane's {loaded}"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):  # lazy imports inside functions count too
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


# Each role folder and what it may not import (`platform/stoker/__init__.py` draws the layers).
FORBIDDEN = {
    "spec": ("stoker.cli", "stoker.serve", "stoker.api", "stoker.control", "stoker.gateway", "stoker.engine"),
    "gateway": ("stoker.cli", "stoker.serve", "stoker.api", "stoker.control", "warm_pool.pool"),
    "engine": ("stoker.cli", "stoker.serve", "stoker.api", "stoker.control", "stoker.gateway"),
    "node": ("stoker.cli", "stoker.serve", "stoker.api", "stoker.control", "stoker.gateway"),
    "control": ("stoker.cli", "stoker.serve", "stoker.api"),
    "api": ("stoker.cli", "stoker.serve"),
    "serve": ("stoker.cli",),
    "tls": ("stoker.cli", "stoker.serve", "stoker.api", "stoker.control", "stoker.gateway", "stoker.engine"),
}


def test_imports_point_down_only() -> None:
    wrong = []
    for folder, forbidden in FORBIDDEN.items():
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            for module in sorted(_imports(path)):
                if module.startswith(forbidden):
                    wrong.append(f"{path.relative_to(PACKAGE)} imports {module}")
    assert wrong == []


def test_the_top_level_holds_only_the_shared_helpers() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert top == ["__init__.py", "errors.py", "http.py", "paths.py"]
