"""OpenAI response objects for `/v1/chat/completions` and `/v1/completions`, whole or streamed.

A chat stream opens with `{"role": "assistant", "content": ""}`, as vLLM 0.32's serving_chat
does, but only once the first token exists: the endpoint writes that chunk and the first token's
in one write, so a client that times its first chunk measures the real time to first token
(sent at admission, before any token, it read as a few milliseconds whatever the prefill cost).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any

from stoker.engine.logprobs import LegacyLogprobs, TokenLogprob, chat_content
from stoker.engine.protocol import Kind
from stoker.engine.tools import Arguments, CallStart, Content, Event


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class ResponseShape:
    """Builds the response objects of one request, chat or completion, whole or streamed. With
    `text_of` (a token's text), every choice carries the logprobs of its tokens."""

    def __init__(
        self, kind: Kind, request_id: str, model: str, text_of: Callable[[int], str] | None = None
    ) -> None:
        self.kind = kind
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.object = "chat.completion" if kind == "chat" else "text_completion"
        self._text_of = text_of
        self._legacy = LegacyLogprobs(text_of) if text_of is not None and kind == "completion" else None

    def _logprobs(self, records: Sequence[TokenLogprob], whole: bool = False) -> dict | None:
        if self._text_of is None or not (records or whole):  # a chunk without tokens has none
            return None
        if self._legacy is not None:
            return self._legacy.block(records)
        return {"content": chat_content(records, self._text_of)}

    def whole(
        self,
        choices: Sequence[tuple[str, str, Sequence[TokenLogprob], list[dict] | None]],
        prompt_tokens: int,
        completion_tokens: int,
    ) -> dict:
        """The answer whole: one choice per (text, finish reason, logprob records, tool calls or
        None), indexed in order; the prompt's tokens counted once, every choice's completion tokens
        together. A chat answer with calls has `tool_calls` and its text (or null) as content."""
        out = []
        for index, (text, finish_reason, records, calls) in enumerate(choices):
            logprobs = self._logprobs(records, whole=True)
            if self.kind == "chat":
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if calls:
                    message = {"role": "assistant", "content": text or None, "tool_calls": calls}
                out.append(
                    {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
                )
            else:
                out.append(
                    {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
                )
        return self._envelope(self.object, out, usage=usage(prompt_tokens, completion_tokens))

    def role_chunk(self, index: int = 0) -> dict:
        choice = {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return self._envelope("chat.completion.chunk", [choice])

    def chunk(
        self,
        text: str,
        finish_reason: str | None = None,
        records: Sequence[TokenLogprob] = (),
        index: int = 0,
    ) -> dict:
        logprobs = self._logprobs(records)
        if self.kind == "chat":
            delta: dict[str, Any] = {"content": text}
            if finish_reason is not None and not text:
                delta = {}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice])

    def event_chunks(
        self, events: Sequence[Event], records: Sequence[TokenLogprob], index: int
    ) -> list[dict]:
        """A chat stream's chunks for what a `tools.CallReader` read: content as content, a call's
        start with its id, type and name, its arguments as they come (OpenAI's tool-call deltas).
        The tokens' logprobs go with the first chunk."""
        out = []
        for event in events:
            if isinstance(event, Content):
                delta: dict[str, Any] = {"content": event.text}
            elif isinstance(event, CallStart):
                function = {"name": event.name, "arguments": ""}
                call = {"index": event.index, "id": event.id, "type": "function", "function": function}
                delta = {"tool_calls": [call]}
            else:
                assert isinstance(event, Arguments)
                delta = {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
            logprobs = self._logprobs(records) if not out else None
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}
            out.append(self._envelope("chat.completion.chunk", [choice]))
        return out

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return self._envelope(obj, [], usage=usage(prompt_tokens, completion_tokens))

    def _envelope(self, obj: str, choices: list, **extra: Any) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }


def sse(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()
