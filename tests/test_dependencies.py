"""Every third-party module the product code imports is declared in pyproject.toml.

A module that only arrives as some other package's dependency (PyYAML through lightkube, numpy
through torch) works until that package drops it; then `pip install stoker` gives an ImportError at
the first YAML price table. This reads every import in the product packages (lazy ones inside
functions too) with `ast`, maps each top-level module to the distribution that provides it, and
names any that `[project].dependencies` does not declare.

An optional extra may declare a module instead only where the product imports it lazily (inside a
function, or under `if TYPE_CHECKING:`) and `OPTIONAL` below names the extra: a module-level import
of an extra would break `import` for everyone who did not install it.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = {  # top-level package -> its source folder (pyproject's [tool.setuptools.package-dir])
    "stoker": ROOT / "platform" / "stoker",
    "activator": ROOT / "activator",
    "warm_pool": ROOT / "warm_pool",
    "snapshots": ROOT / "snapshots",
}

# Modules the product may import that this venv does not install (`make test` leaves the `gpu`
# extra out), with the distribution that provides each; installed ones are looked up in the venv.
NOT_INSTALLED = {
    "pynvml": "nvidia-ml-py",
}

# Modules declared by an optional extra rather than by the core dependencies: the extra that
# declares each. Allowed only for modules the product imports lazily.
OPTIONAL = {
    "pynvml": "gpu",  # stoker.node.gpu_metrics, warm_pool.fleet (`stoker up --share-gpus`)
    "opentelemetry": "otel",  # stoker.gateway.otel, imported when tracing is on
    "matplotlib": "sim",  # `stoker simulate --plot`
}


@dataclass
class Uses:
    eager: set[str] = field(default_factory=set)  # "path:line" of module-level imports
    lazy: set[str] = field(default_factory=set)  # inside a function or `if TYPE_CHECKING:`


class _Imports(ast.NodeVisitor):
    def __init__(self, where: str, found: dict[str, Uses]) -> None:
        self.where = where
        self.found = found
        self.depth = 0  # functions and TYPE_CHECKING blocks around the current node

    def _add(self, module: str, node: ast.AST) -> None:
        uses = self.found.setdefault(module.split(".")[0], Uses())
        (uses.lazy if self.depth else uses.eager).add(f"{self.where}:{node.lineno}")

    def _nested(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _nested

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
            isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
        ):
            self.depth += 1
            for child in node.body:
                self.visit(child)
            self.depth -= 1
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0 and node.module:  # relative imports are first-party
            self._add(node.module, node)

    def visit_Call(self, node: ast.Call) -> None:
        # importlib.import_module("name") with a literal: an import too, made at run time.
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if (
            name == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            self.depth += 1
            self._add(node.args[0].value, node)
            self.depth -= 1
        self.generic_visit(node)


@functools.cache
def third_party_imports() -> dict[str, Uses]:
    found: dict[str, Uses] = {}
    for folder in PRODUCT.values():
        for path in sorted(folder.rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            _Imports(str(path.relative_to(ROOT)), found).visit(tree)
    return {
        module: uses
        for module, uses in found.items()
        if module not in sys.stdlib_module_names and module not in PRODUCT and module != "__future__"
    }


def _name(requirement: str) -> str:
    """PEP 503's normalised project name of a requirement string ("PyYAML>=6" -> "pyyaml")."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert match, f"unreadable requirement {requirement!r} in pyproject.toml"
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def declared() -> tuple[set[str], dict[str, set[str]]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    core = {_name(r) for r in project["dependencies"]}
    extras = {extra: {_name(r) for r in reqs} for extra, reqs in project["optional-dependencies"].items()}
    return core, extras


@functools.cache
def _installed() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()  # reads every dist-info: ~1 s


def distributions(module: str) -> set[str]:
    """The normalised names of the distributions that provide top-level `module` (empty: unknown)."""
    installed = _installed().get(module, [])
    names = set(installed) or ({NOT_INSTALLED[module]} if module in NOT_INSTALLED else set())
    return {_name(n) for n in names}


def test_the_scan_sees_the_known_imports():
    # A guard on the scanner itself: lazy imports count, and module-level ones are told apart.
    found = third_party_imports()
    assert any(u.startswith("snapshots/s3.py:") for u in found["botocore"].eager)  # from botocore import ...
    assert found["yaml"].lazy and not found["yaml"].eager  # imported inside the readers only
    assert "torch" in found and "stoker" not in found and "os" not in found


def test_every_third_party_import_is_declared():
    core, extras = declared()
    problems = []
    for module, uses in sorted(third_party_imports().items()):
        where = ", ".join(sorted(uses.eager | uses.lazy)[:3])
        dists = distributions(module)
        if not dists:
            problems.append(
                f"{module} ({where}): not installed here and not in NOT_INSTALLED; "
                "add the distribution that provides it"
            )
        elif dists & core:
            continue
        elif module in OPTIONAL and dists & extras.get(OPTIONAL[module], set()):
            if uses.eager:
                problems.append(
                    f"{module} comes from the optional extra [{OPTIONAL[module]}] but is imported "
                    f"at module level ({', '.join(sorted(uses.eager))}): import it where it is used"
                )
        else:
            problems.append(
                f"{module} ({where}) is provided by {' or '.join(sorted(dists))}, which "
                "[project].dependencies does not declare"
                + (f" (nor the extra [{OPTIONAL[module]}])" if module in OPTIONAL else "")
            )
    assert not problems, "undeclared dependencies:\n  " + "\n  ".join(problems)


def test_the_tables_name_modules_the_product_imports():
    # No stale entries: each exception above is still needed.
    found = third_party_imports()
    _, extras = declared()
    assert set(NOT_INSTALLED) <= set(found), set(NOT_INSTALLED) - set(found)
    assert set(OPTIONAL) <= set(found), set(OPTIONAL) - set(found)
    for module, extra in OPTIONAL.items():
        assert extra in extras, f"OPTIONAL names extra [{extra}] for {module}; pyproject.toml has none"
