"""The activator's record of which adapters each instance holds: bounded by the live instances."""

from __future__ import annotations

from activator.adapters import AdapterRef, Adapters


def test_what_instances_that_left_held_is_forgotten():
    adapters = Adapters(lambda: None, lambda name, seconds: None)
    ref = AdapterRef("a1", "/store/x", "x" * 64, 1)
    for endpoint in ("i1", "i2", "i3"):
        adapters._held.setdefault(endpoint, {})[ref.name] = ref.snapshot_id
    adapters.gone({"i2"})
    assert adapters.holds("i2", ref) and not adapters.holds("i1", ref) and not adapters.holds("i3", ref)
    adapters.gone(set())
    assert not adapters.tracked()
