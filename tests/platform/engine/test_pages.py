"""`stoker.engine.pages` on real memory: the kernel's own accounting (/proc/self) says what happened."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from stoker.engine import pages

MIB = 1 << 20


def rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


def mapped_rss(path: Path) -> int:
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split(maxsplit=1)[0]
        if "-" in first and not first.endswith(":"):
            inside = line.split()[-1] == str(path)
        elif inside and first == "Rss:":
            total += int(line.split()[1]) * 1024
    return total


def test_release_pages_frees_the_memory_and_the_tensor_reads_zeros():
    t = torch.ones(64 * MIB, dtype=torch.uint8)
    before = rss_anon()
    released = pages.release_pages(t)
    assert 64 * MIB - 2 * pages.PAGE_BYTES <= released <= 64 * MIB
    assert before - rss_anon() >= 60 * MIB
    # The whole pages read zeros now; only the partial pages at the ends may keep their ones.
    assert int(t.sum()) <= 2 * pages.PAGE_BYTES
    t.fill_(3)  # still a valid tensor: written, its memory comes back
    assert int(t.sum()) == 3 * 64 * MIB


def test_release_pages_does_nothing_to_an_empty_or_tiny_tensor():
    assert pages.release_pages(torch.empty(0)) == 0
    small = torch.ones(100)
    assert pages.release_pages(small) == 0  # no whole page inside it
    assert int(small.sum()) == 100


@pytest.mark.parametrize("populate", [True, False])
def test_fault_in_maps_every_page_of_mapped_weights(tmp_path, monkeypatch, populate):
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.randn(2 * MIB), "b": torch.randn(MIB)}, str(path))  # 12 MiB of fp32
    if not populate:  # the fallback for kernels before 5.14: one byte read per page
        monkeypatch.setattr(pages, "_populate", lambda address, length: False)
    module = torch.nn.Module()
    with safe_open(path, framework="pt") as f:
        for key in f.keys():
            module.register_parameter(key, torch.nn.Parameter(f.get_tensor(key), requires_grad=False))
    assert mapped_rss(path) < 4 * MIB  # mapped, hardly faulted in
    covered = pages.fault_in(module)
    assert covered == 3 * MIB * 4
    assert mapped_rss(path) >= 12 * MIB
    expected = {k: v.clone() for k, v in module.named_parameters()}
    assert all(torch.equal(v, expected[k]) for k, v in module.named_parameters())
    del module, expected
    gc.collect()


def test_fault_in_skips_meta_tensors():
    module = torch.nn.Linear(4, 4, device="meta")
    assert pages.fault_in(module) == 0


if not os.path.exists("/proc/self/smaps"):  # pragma: no cover
    pytest.skip("needs Linux /proc", allow_module_level=True)
