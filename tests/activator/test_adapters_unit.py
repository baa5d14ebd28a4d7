"""The activator's record of which adapters each instance holds (bounded by the live instances), its
loads against a busy engine and against a name the engine has already, and its prefetcher."""

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


class LoraEngine:
    """vLLM's run-time LoRA API as an engine answers it, over real loopback HTTP: a load of a name
    it has answers 400 "already been loaded" unless `load_inplace`; `/v1/models` lists each adapter
    with its `root`, the directory it was loaded from."""

    def __init__(self) -> None:
        self.loaded: dict[str, str] = {}  # name -> path
        self.posts: list[dict] = []

    async def __call__(self, scope, receive, send) -> None:
        import json

        from starlette.requests import Request
        from starlette.responses import JSONResponse, PlainTextResponse

        request = Request(scope, receive)
        if request.url.path == "/v1/models":
            cards = [
                {"id": n, "object": "model", "root": p, "parent": "base"} for n, p in self.loaded.items()
            ]
            response = JSONResponse({"object": "list", "data": [{"id": "base", "root": "/b"}, *cards]})
        else:
            body = json.loads(await request.body())
            self.posts.append(body)
            if body["lora_name"] in self.loaded and not body.get("load_inplace"):
                message = f"The lora adapter '{body['lora_name']}' has already been loaded."
                response = JSONResponse({"error": {"message": message}}, status_code=400)
            elif body["lora_path"].endswith("/bad"):
                response = JSONResponse({"error": {"message": "no adapter_config.json"}}, status_code=400)
            else:
                self.loaded[body["lora_name"]] = body["lora_path"]
                response = PlainTextResponse("Success")
        await response(scope, receive, send)


async def test_a_name_the_engine_has_from_this_directory_is_held_as_it_is_and_another_is_reloaded():
    """Another gateway (or the controller, ahead of the request) loaded it: its `root` says whether
    the bytes are this revision's; only if not is it loaded again in place."""
    import aiohttp

    from tests.activator.conftest import Ep, running

    engine, loads = LoraEngine(), []
    engine.loaded["a1"] = "/store/" + "x" * 64
    async with running(engine) as (url,), aiohttp.ClientSession() as session:
        adapters = Adapters(lambda: session, lambda name, seconds: loads.append(name))
        same = AdapterRef("a1", "/store/" + "x" * 64, "x" * 64, 1)
        await adapters.ensure(Ep("i1", url), same)
        assert adapters.holds("i1", same) and loads == [] and len(engine.posts) == 1  # no load in place
        other = AdapterRef("a1", "/store/" + "y" * 64, "y" * 64, 1)  # a new revision under the name
        await adapters.ensure(Ep("i1", url), other)
        assert engine.posts[-1].get("load_inplace") is True and engine.loaded["a1"] == other.path
        assert adapters.holds("i1", other) and loads == ["a1"]


async def test_the_prefetcher_loads_where_the_adapter_s_requests_go_once_and_says_why_not():
    import aiohttp

    from activator.adapters import Prefetcher
    from activator.balancer import pick_by_prefix
    from tests.activator.conftest import Ep, running

    e1, e2, loads = LoraEngine(), LoraEngine(), []
    async with running(e1, e2) as (u1, u2), aiohttp.ClientSession() as session:
        eps = [Ep("i1", u1), Ep("i2", u2)]
        live = list(eps)
        adapters = Adapters(lambda: session, lambda name, seconds: loads.append(name))
        prefetcher = Prefetcher(adapters, lambda: live, lambda: {}, lambda: 1.25)
        ref = AdapterRef("a1", "/store/" + "x" * 64, "x" * 64, 12345)
        owner = pick_by_prefix(eps, {}, ref.key, 1.25)
        assert await prefetcher.prefetch(ref) == owner.id  # the instance a request for it would go to
        there, elsewhere = (e1, e2) if owner.id == "i1" else (e2, e1)
        assert loads == ["a1"] and there.loaded == {"a1": ref.path} and not elsewhere.loaded
        assert await prefetcher.prefetch(ref) is None and loads == ["a1"]  # held there: nothing to do
        bad = AdapterRef("a2", "/store/bad", "z" * 64, 99)
        assert await prefetcher.prefetch(bad) is None  # refused: logged, not raised
        live.clear()
        assert await prefetcher.prefetch(AdapterRef("a3", "/store/" + "w" * 64, "w" * 64, 7)) is None
        assert not adapters.tracked()  # what the instances that left held is forgotten
