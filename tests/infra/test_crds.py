"""The chart's CustomResourceDefinitions (infra/helm/stoker/crds/) are the code's: one file per CRD
`stoker.spec.resources.crds()` returns, named `<plural>.<group>.yaml`, equal to it as parsed YAML,
none for a CRD that is gone; `stoker crds`, run as a process, prints the same objects. Helm installs
crds/ as plain YAML, never rendered (helmlite does not read it either), so no file holds a template
action. `make crds` rewrites the files when a test here fails.
"""

from __future__ import annotations

import os
import subprocess

import kubernetes_validate
import pytest
import yaml

from stoker.cli.crds import HEADER
from stoker.spec.resources import crds
from tests.conftest import STOKER
from tests.deadlines import CLI
from tests.infra.test_chart import CHART, KUBERNETES, oldest_kubernetes

CRDS = CHART / "crds"


def test_each_crd_the_code_defines_has_its_file_and_no_other_file_is_there():
    expected = sorted(f"{crd['spec']['names']['plural']}.{crd['spec']['group']}.yaml" for crd in crds())
    assert sorted(p.name for p in CRDS.iterdir()) == expected, "run `make crds`"


@pytest.mark.parametrize("crd", crds(), ids=lambda crd: crd["metadata"]["name"])
def test_each_file_is_what_the_code_generates(crd):
    text = (CRDS / f"{crd['metadata']['name']}.yaml").read_text()
    assert text.startswith(HEADER) and "`stoker crds`" in HEADER
    assert yaml.safe_load(text) == crd, "run `make crds`"
    assert "{{" not in text  # Helm would ship it as it is, braces and all


@pytest.mark.parametrize("version", [oldest_kubernetes(), KUBERNETES])
def test_every_crd_passes_the_strict_api_schema(version):
    for crd in crds():
        kubernetes_validate.validate(crd, version, strict=True)


def test_stoker_crds_prints_them_as_one_yaml_stream(tmp_path):
    # No data dir and no server: HOME and STOKER_HOME point at an empty folder nothing may write to.
    home = tmp_path / "home"
    home.mkdir()
    done = subprocess.run(
        [STOKER, "crds"],
        capture_output=True,
        text=True,
        timeout=CLI,
        env={**os.environ, "HOME": str(home), "STOKER_HOME": str(home / "stoker")},
    )
    assert done.returncode == 0, done.stderr
    assert list(yaml.safe_load_all(done.stdout)) == crds()
    assert list(home.iterdir()) == []


def test_stoker_crds_out_rewrites_the_folder_and_removes_a_crd_that_is_gone(tmp_path):
    (tmp_path / "gone.stoker.dev.yaml").write_text(HEADER + "kind: CustomResourceDefinition\n")
    (tmp_path / "notes.yaml").write_text("# not ours: kept\n")
    done = subprocess.run(
        [STOKER, "crds", "--out", str(tmp_path)], capture_output=True, text=True, timeout=CLI
    )
    assert done.returncode == 0, done.stderr
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(["notes.yaml", *(f"{c['metadata']['name']}.yaml" for c in crds())])
    for crd in crds():
        assert (tmp_path / f"{crd['metadata']['name']}.yaml").read_text() == (
            CRDS / f"{crd['metadata']['name']}.yaml"
        ).read_text()
