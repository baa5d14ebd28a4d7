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


async def test_a_load_while_every_slot_is_busy_is_tried_again_until_one_frees():
    """The engine's 503 (every adapter slot held by running requests) passes: the load is tried
    again, with a backoff, and succeeds once a slot frees."""
    from types import SimpleNamespace

    answers = [(503, '{"error": {"message": "busy"}}')] * 2 + [(200, "Success")]
    loads = []
    adapters = Adapters(lambda: None, lambda name, seconds: loads.append(name))

    async def post(endpoint, ref, *, inplace):
        return answers.pop(0)

    adapters._post = post
    endpoint = SimpleNamespace(id="i1")
    ref = AdapterRef("a1", "/store/x", "x" * 64, 1)
    await adapters.ensure(endpoint, ref)
    assert answers == [] and loads == ["a1"] and adapters.holds("i1", ref)
