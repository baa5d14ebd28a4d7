"""Wakes at the floor, on real engine processes: a woken engine answers exactly as one that never
slept, holds none of its KV cache's memory while asleep, allocates none of it again on wake, and has
its weights mapped in before `/wake_up` answers. And what serving does not need is not imported
until a request asks for it (llguidance, for structured output).

Memory is read from /proc (`RssAnon`, and the `Rss` of the snapshot's mappings in `smaps`): what
the kernel accounts, not timings.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.deadlines import COLD_ANSWER

# A prompt of several full 32-token KV blocks: the manager's prefix cache hashes them, and a woken
# engine must not match them against blocks whose memory sleep handed back (they read zeros).
PROMPT = " ".join(["the model reads a long prompt about the capital of France"] * 12)
GREEDY = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 3}
KV_TOKENS = 131072  # the tiny model's KV: 2 layers x (K, V) x 2 heads x 16 x 4 B = 512 B a token: 64 MiB
KV_BYTES = KV_TOKENS * 512
MIB = 1 << 20


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def mapped_rss(pid: int, directory: Path, suffix: str = ".safetensors") -> int:
    """Bytes of `directory`'s `*suffix` files mapped into the process's page tables (smaps `Rss`)."""
    total, inside = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        first = line.split(maxsplit=1)[0]
        if "-" in first and not first.endswith(":"):  # a mapping's header line
            path = line.split()[-1] if len(line.split()) >= 6 else ""
            inside = path.startswith(str(directory)) and path.endswith(suffix)
        elif inside and first == "Rss:":
            total += int(line.split()[1]) * 1024
    return total


def answer(url: str) -> dict:
    r = httpx.post(f"{url}/v1/completions", json=GREEDY, timeout=COLD_ANSWER)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return {"text": choice["text"], "logprobs": choice["logprobs"]}


def test_woken_engine_answers_as_one_that_never_slept(engine, fresh_engine):
    # `engine`, the session's shared engine, never sleeps; `woken` is put to sleep at each level twice.
    never, woken = engine, fresh_engine()
    reference = answer(never.url)
    assert answer(woken.url) == reference  # its prefix cache now holds the prompt's blocks
    for level in (1, 2, 1, 2):
        assert httpx.post(f"{woken.url}/sleep?level={level}", timeout=COLD_ANSWER).status_code == 200
        assert httpx.post(f"{woken.url}/wake_up", timeout=COLD_ANSWER).status_code == 200
        assert answer(woken.url) == reference, f"after a level-{level} wake"
    assert answer(never.url) == reference


def test_sleep_hands_back_the_kv_cache_and_wake_does_not_allocate_it_again(fresh_engine, tiny_snapshot):
    """One engine, what it does not pay for: its weights are in the page tables before it is READY,
    sleep hands back the KV cache and wake does not write it again, and llguidance (structured
    output) is not imported until a request asks for it."""
    e = fresh_engine("--kv-cache-tokens", str(KV_TOKENS))
    pid = e.proc.pid
    size = sum(p.stat().st_size for p in tiny_snapshot.glob("*.safetensors"))
    assert mapped_rss(pid, tiny_snapshot) >= 0.9 * size  # mapped in by the load, before READY
    answer(e.url)
    awake = status_kib(pid, "RssAnon") * 1024
    assert httpx.post(f"{e.url}/sleep?level=1", timeout=COLD_ANSWER).status_code == 200
    asleep = status_kib(pid, "RssAnon") * 1024
    assert awake - asleep >= 0.75 * KV_BYTES, (awake / MIB, asleep / MIB)
    assert mapped_rss(pid, tiny_snapshot) == 0  # the weights are unmapped too

    assert httpx.post(f"{e.url}/wake_up", timeout=COLD_ANSWER).status_code == 200
    # The weights are in the page tables before the first request: it takes no page faults on them.
    assert mapped_rss(pid, tiny_snapshot) >= 0.9 * size
    answer(e.url)  # the kept manager serves; a new one would have written its whole cache by now
    woken = status_kib(pid, "RssAnon") * 1024
    assert awake - woken >= 0.75 * KV_BYTES, "the wake wrote the whole KV cache again"

    assert not llguidance_loaded(pid)  # serving plain requests, sleeping and waking never needed it
    body = {
        "model": "tiny",
        "prompt": "JSON:",
        "max_tokens": 40,
        "temperature": 0,
        "response_format": {"type": "json_object"},
    }
    r = httpx.post(f"{e.url}/v1/completions", json=body, timeout=COLD_ANSWER)
    assert r.status_code == 200, r.text
    assert llguidance_loaded(pid)
    bad = {
        **body,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}},
    }
    r = httpx.post(f"{e.url}/v1/completions", json=bad, timeout=COLD_ANSWER)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


def llguidance_loaded(pid: int) -> bool:
    """Whether llguidance's native library is mapped into the process: imported, in other words."""
    return any("llguidance" in line for line in Path(f"/proc/{pid}/maps").read_text().splitlines())
