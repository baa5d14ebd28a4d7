"""Prefix affinity: requests that share a prompt prefix go to the same instance, within a load bound.

An engine keeps the KV blocks of prompts it has seen (vLLM's prefix cache): a request whose prompt
starts like an earlier one on the same instance skips the prefill of that part. Least-outstanding
spreads a deployment's few long system prompts over every instance, so each instance must cache
all of them; sent by prefix, each caches only its share, and a working set of prefixes that
overflows one instance's cache can still fit in the fleet's.

The key of a request is a hash of its prompt's first `Balance.prefix_chars` characters, the chat
messages laid out the way a chat template lays them out (each role then its content, in order: the
system prompt, which clients send first, comes first). Characters stand in for tokens, since the
activator has no tokenizer: English runs about 4 characters a token, so the default 512 characters
are about 128 tokens, one of vLLM's CPU KV blocks (128 tokens) or 8 of its GPU ones (16). The key
must be shorter than the shared part to group requests: a key that reaches into each user's own
question gives each request a key of its own, and affinity then only spreads them at random.

The key picks the instance by consistent hashing with bounded loads (`balancer.pick_by_prefix`):
the same key goes to the same instance while that one is below `bound` times the mean load, and to
the next one along the ring when it is not.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from activator.balancer import point

LEAST_OUTSTANDING = "least-outstanding"
PREFIX = "prefix"
MODES = (LEAST_OUTSTANDING, PREFIX)


@dataclass(frozen=True)
class Balance:
    """How a deployment's activator picks an instance.

    `mode`: "least-outstanding" (the fewest requests in flight) or "prefix" (by prompt prefix,
    bounded). `bound`: in prefix mode, no instance takes a request that would put it above this
    factor over the mean outstanding load (1.0: perfectly even, so affinity gives way often;
    1.25 keeps it for most requests while no instance carries a quarter more than its share).
    `prefix_chars`: how many leading characters of the rendered prompt form the key.
    """

    mode: str = LEAST_OUTSTANDING
    bound: float = 1.25
    prefix_chars: int = 512

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"balance mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        bound = self.bound
        ok = isinstance(bound, int | float) and not isinstance(bound, bool) and 1.0 <= bound <= 10.0
        if not ok:
            raise ValueError(f"affinity bound must be a number in [1.0, 10.0], got {bound!r}")
        chars = self.prefix_chars
        if isinstance(chars, bool) or not isinstance(chars, int) or not 16 <= chars <= 1_000_000:
            raise ValueError(f"prefix_chars must be an integer in [16, 1000000], got {chars!r}")

    @property
    def by_prefix(self) -> bool:
        return self.mode == PREFIX


# ---- the key of a request ----------------------------------------------------------------------------


def request_key(body: bytes, balance: Balance, parsed: Mapping | None = None) -> int | None:
    """The prefix key of a request (`parsed`: its JSON body, if the caller has it already), or None
    when it has no prompt we can read: then it goes to the least-loaded instance."""
    if parsed is None:
        try:
            parsed = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return None
    if not isinstance(parsed, Mapping):
        return None
    text = prompt_prefix(parsed, balance.prefix_chars)
    return None if text is None else point(text)


def prompt_prefix(body: Mapping, chars: int) -> str | None:
    """The first `chars` characters of the prompt as an engine would see it: chat messages rendered
    canonically, or a completion's prompt. None when the body has neither in a form we know."""
    messages = body.get("messages")
    if messages is not None:
        return _render_chat(messages, chars)
    return _render_prompt(body.get("prompt"), chars)


def _render_chat(messages: object, chars: int) -> str | None:
    if not isinstance(messages, list) or not messages:
        return None
    out: list[str] = []
    size = 0
    for message in messages:
        if not isinstance(message, Mapping):
            return None
        role = message.get("role")
        content = _content_text(message.get("content"))
        if not isinstance(role, str) or content is None:
            return None
        # As ChatML lays it out (SmolLM2, Qwen): the exact markers do not matter, only that the
        # same messages always give the same text and different ones different text.
        part = f"<|{role}|>\n{content}\n"
        out.append(part)
        size += len(part)
        if size >= chars:
            break
    return "".join(out)[:chars]


def _content_text(content: object) -> str | None:
    """A message's content as text: a string; a list of parts, text parts as they are and others
    (images, audio) as their type; None (an assistant's tool call) as nothing. Else None."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    texts = []
    for part in content:
        if not isinstance(part, Mapping):
            return None
        kind = part.get("type")
        text = part.get("text")
        if kind == "text" and isinstance(text, str):
            texts.append(text)
        elif isinstance(kind, str):
            texts.append(f"<{kind}>")
        else:
            return None
    return "".join(texts)


def _render_prompt(prompt: object, chars: int) -> str | None:
    """A completion's prompt: a string, token ids, or a batch of either (the first one: a batch goes
    to one instance as a whole)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt[:chars] if prompt else None
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt[:chars]):
        # Token ids: one character stands for about a quarter of a token, so chars // 4 of them.
        return " ".join(map(str, prompt[: max(1, chars // 4)]))
    return None
