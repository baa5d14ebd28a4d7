"""The Response object of `/v1/responses` and its stream of events, built as a generation's text comes.

A `ResponseRun` is fed the text the engine writes (read into content and calls by a
`tools.CallReader` where tools constrain the answer, as the chat route reads them) and returns the
events it makes, each numbered by `sequence_number` from 0:

    response.created, response.in_progress                        (the Response, no output yet)
    a message:  response.output_item.added ─▶ response.content_part.added
                ─▶ response.output_text.delta × n ─▶ response.output_text.done
                ─▶ response.content_part.done ─▶ response.output_item.done
    each call:  response.output_item.added ─▶ response.function_call_arguments.delta × n
                ─▶ response.function_call_arguments.done ─▶ response.output_item.done
    response.completed, or response.incomplete (cut by max_output_tokens), with the whole Response

An item is closed when the next begins or the answer ends, so every item added is done before the
Response completes (the openai client's stream helper refuses a Response with unfinished items).
An answer with no text and no calls still has its message, empty, as OpenAI answers. The whole
(not streamed) answer is the same run fed the text at once: the same Response either way.

The Response puts `usage` last, and in it the totals before their details: the gateway reads an
answer's usage from its last bytes (`stoker.gateway.limits.UsageTap`), and a stream's from its
final event. Pure: no I/O, no clock (`created_at` is handed in).
"""

from __future__ import annotations

import copy
import json
import uuid
from typing import Any

from stoker.engine.tools import Arguments, CallReader, CallStart, Content, Event, ToolSpec
from stoker.errors import APIError


def usage(input_tokens: int, output_tokens: int) -> dict:
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "total_tokens": input_tokens + output_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens_details": {"reasoning_tokens": 0},
    }


class ResponseRun:
    """One Response: its events as the text comes (`start`, `feed`, `finish`), then `response`."""

    def __init__(
        self, response_id: str, model: str, echo: dict, spec: ToolSpec | None, created_at: int
    ) -> None:
        self.id, self.model, self.echo, self.created_at = response_id, model, echo, created_at
        self._reader = CallReader(spec) if spec is not None and spec.constrained else None
        self.output: list[dict] = []  # the items, each as it stands
        self._open: dict | None = None  # the item being written
        self._text: list[str] = []  # the open message's text
        self._sequence = 0
        self.response: dict | None = None  # set by `finish`

    def start(self) -> list[dict]:
        snapshot = self._response("in_progress")
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]  # fmt: skip

    def feed(self, text: str) -> list[dict]:
        read = self._reader.feed(text) if self._reader is not None else [Content(text)] if text else []
        return self._read(read)

    def finish(self, finish_reason: str | None, input_tokens: int, output_tokens: int) -> list[dict]:
        """The last events; `response` is then the whole Response. An answer cut by its token budget
        is `incomplete` (its last item too), as OpenAI's is when `max_output_tokens` ends it."""
        events = self._read(self._reader.close()) if self._reader is not None else []
        if not self.output:
            events += self._open_message()
        cut = finish_reason == "length"
        events += self._close("incomplete" if cut else "completed")
        status = "incomplete" if cut else "completed"
        details = {"reason": "max_output_tokens"} if cut else None
        self.response = self._response(status, details, usage(input_tokens, output_tokens))
        return [*events, self._event(f"response.{status}", response=self.response)]

    def failed(self, error: APIError) -> list[dict]:
        """The end of a stream that an error cut after its first byte: OpenAI's `error` event, then
        the Response as `failed`."""
        code = error.code or ("server_error" if error.status >= 500 else "invalid_request_error")
        event = self._event("error", code=code, message=error.message, param=error.param)
        body = self._response("failed", error={"code": code, "message": error.message})
        return [event, self._event("response.failed", response=body)]

    def _read(self, read: list[Event]) -> list[dict]:
        out: list[dict] = []
        for event in read:
            if isinstance(event, Content):
                if self._open is None or self._open["type"] != "message":
                    out += self._close("completed") + self._open_message()
                self._text.append(event.text)
                out.append(self._event("response.output_text.delta", **self._at(), content_index=0,
                                       delta=event.text, logprobs=[]))  # fmt: skip
            elif isinstance(event, CallStart):
                out += self._close("completed")
                item = {"id": "fc_" + uuid.uuid4().hex, "type": "function_call", "status": "in_progress",
                        "call_id": event.id, "name": event.name, "arguments": ""}  # fmt: skip
                out.append(self._added(item))
            else:
                assert isinstance(event, Arguments) and self._open is not None
                self._open["arguments"] += event.text
                out.append(
                    self._event("response.function_call_arguments.delta", **self._at(), delta=event.text)
                )
        return out

    def _open_message(self) -> list[dict]:
        item = {"id": "msg_" + uuid.uuid4().hex, "type": "message", "status": "in_progress",
                "role": "assistant", "content": []}  # fmt: skip
        added = self._added(item)
        part = self._event("response.content_part.added", **self._at(), content_index=0, part=_part(""))
        return [added, part]

    def _close(self, status: str) -> list[dict]:
        """The open item's last events, with the item as it ends."""
        item, out = self._open, []
        if item is None:
            return out
        if item["type"] == "message":
            text, self._text = "".join(self._text), []
            out.append(self._event("response.output_text.done", **self._at(), content_index=0, text=text,
                                   logprobs=[]))  # fmt: skip
            out.append(
                self._event("response.content_part.done", **self._at(), content_index=0, part=_part(text))
            )
            item["content"] = [_part(text)]
        else:
            out.append(self._event("response.function_call_arguments.done", **self._at(),
                                   name=item["name"], arguments=item["arguments"]))  # fmt: skip
        item["status"] = status
        out.append(
            self._event(
                "response.output_item.done", output_index=len(self.output) - 1, item=copy.deepcopy(item)
            )
        )
        self._open = None
        return out

    def _added(self, item: dict) -> dict:
        self.output.append(item)
        self._open = item
        return self._event(
            "response.output_item.added", output_index=len(self.output) - 1, item=copy.deepcopy(item)
        )

    def _at(self) -> dict:
        return {"item_id": self._open["id"], "output_index": len(self.output) - 1}

    def _event(self, kind: str, **fields: Any) -> dict:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _response(self, status: str, incomplete: dict | None = None, used: dict | None = None,
                  error: dict | None = None) -> dict:  # fmt: skip
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "model": self.model,
            "output": copy.deepcopy(self.output),
            **self.echo,
            "usage": used,  # last: see the module's docstring
        }


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def sse(event: dict) -> bytes:
    """One event as the Responses API streams it: its type as the SSE event's name, then its JSON."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()
