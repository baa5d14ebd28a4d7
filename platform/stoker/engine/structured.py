"""Structured output: `response_format` `json_object` / `json_schema` as a per-request token mask.

Each request with a response format gets its own grammar matcher. Before each of its tokens the
draw step (`draw.py`) asks the matcher which tokens may come next and sets the others' logits to
-inf in that request's row only; after the token is drawn the matcher takes it. Nothing is shared
between requests but the tokenizer, so the constraint composes with continuous batching: the rows
of other requests in the same forward step are untouched. When the JSON is complete the grammar
allows only EOS, so the answer ends there (with `finish_reason: "stop"`); `max_tokens` can still
cut it short (`"length"`), as with OpenAI and vLLM.

The library is llguidance (guidance-ai, MIT; one of vLLM's structured-output backends, and the one
OpenAI credits for its own structured outputs). Measured on this CPU with SmolLM2-135M's tokenizer
(49,152 tokens), two schemas (a record with bounded strings, integers and an array; a nested array
of objects with an enum), 300-step constrained walks on random logits:

| | llguidance 1.9.1 | xgrammar 0.2.9 | outlines-core 0.2.14 |
|---|---|---|---|
| installs | 3.1 MB wheel, no dependencies | 16 MB + apache-tvm-ffi + triton (a 273 MB GPU compiler wheel on Linux x86-64) + pydantic | 2.3 MB wheel, no dependencies |
| tokenizer prep | 0.35 s | 0.11 s | 0.06 s (with our own byte-level decoding: it has no offline HF import) |
| compile one schema | 0.4-1.5 ms | 0.8-5 ms | 50-150 ms (a regex index over the whole vocabulary) |
| mask per token (median / max) | 0.01-0.12 ms / 1.1 ms | 0.002 ms / 0.09 ms | 0.001 ms / 0.05 ms |
| answers valid against the schema | yes | yes | no: ignored `minimum` (an `age` of -66 for `minimum: 0`) |
| unsupported or contradictory schema | an error (`not`, unknown `format`, min > max) | | silently loosened |

A decode step of the embedded model takes tens of milliseconds on this CPU, so every library's
per-token cost is noise (bench/constrained_bench.py measures the end-to-end cost). What decides
it: llguidance installs as one small wheel with no dependencies (xgrammar pulls triton, a GPU
compiler, onto a CPU engine), honours every keyword it accepts and refuses the ones it cannot
(so a schema it cannot enforce is a 400 instead of an answer that ignores part of it — our rule
against silently ignoring a parameter), and compiles per request in about a millisecond
(outlines-core's index costs 50-150 ms per schema).

Options: optional whitespace between JSON tokens is allowed (`whitespace_flexible`, vLLM's
default), bounded (see `OPTIONS`). Measured with the embedded model (greedy, "Describe a person (name, age, hobbies) as
JSON."): with it, a 38-token pretty-printed object that ends by itself, for `{"type": "object"}`
and for a person schema alike; without it, the model, which learnt JSON pretty-printed, loses its
way in the compact form (`{"name":{"name":{"name":...` and a list repeating "hiking") and runs to
its 150-token budget both times. The tokenizer's llguidance form costs 0.35 s to build, so it is
built on the first structured request rather than at start: engine starts are what a serverless
platform waits for. For the same reason llguidance itself (with `llguidance.hf`, which pulls in
transformers' slow-tokenizer conversion: 0.1-0.25 s of imports) is imported by that first request,
not by the engine's start.
"""

from __future__ import annotations

import functools
import json
import threading
from typing import TYPE_CHECKING

import numpy as np
import torch

from stoker.engine.protocol import ResponseFormat
from stoker.errors import invalid

if TYPE_CHECKING:
    import llguidance

# Whitespace between JSON tokens as the model likes it (vLLM's default allows any), but at most 32
# characters at a time: a newline and 4-space indentation 7 levels deep. Unbounded, a model whose
# favourite token in some position is whitespace never ends its answer: measured on the test
# model's tokenizer, a greedy walk that prefers whitespace wrote 3,000 tokens of it without closing
# a 3-field object; with this bound the same walk closed it in 444 tokens. The embedded model's
# pretty-printed answers (see above) are the same with the bound as without.
OPTIONS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{1,32}"}


@functools.cache
def _limits() -> llguidance.LLParserLimits:
    """llguidance's resource limits bound what a hostile schema can cost: its grammar size, the
    lexer's work to build it and per token. Its defaults (500k symbols, ~20 ms of lexer work to
    build, ~15 ms per token at its documented speeds) already bound a request; errors stay terse."""
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


class Grammars:
    """Compiles response formats for one tokenizer; one per loaded model."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_ids: set[int]) -> None:
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size  # the logits' width, which may exceed the tokenizer's size
        self._eos = sorted(eos_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf, n_vocab=self.vocab_size, eos_token=self._eos or None
                )
            return self._tokenizer

    def compile(self, fmt: ResponseFormat) -> Matcher:
        """A fresh matcher for one request; raises `APIError` 400 on `response_format` (or `tools`,
        for a tool's `parameters`) for a schema that is invalid, unsupported or unsatisfiable.
        Blocking (about a millisecond, more for large schemas; the first call also imports
        llguidance and builds the tokenizer): call it off the event loop."""
        import llguidance

        param = "tools" if fmt.kind == "tool_calls" else "response_format"
        if fmt.kind == "tool_calls":  # the schemas inside are checked when the matcher compiles it
            grammar = llguidance.LLMatcher.grammar_from_lark(fmt.source)
        else:
            try:
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    json.loads(fmt.source), defaults=OPTIONS
                )
            except ValueError as exc:
                raise invalid(f"'response_format' has an unusable JSON schema: {exc}", param=param) from None
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0, limits=_limits())
        if matcher.is_error():
            message = _first_line(matcher.get_error())
            raise invalid(f"'{param}' has a JSON schema this engine cannot enforce: {message}", param=param)
        wrapped = Matcher(matcher, self.vocab_size)
        wrapped.allowed()  # the first token's mask, which is what ends a grammar with no value
        if matcher.is_stopped() and not matcher.is_accepting():
            # Ended before its first token, with nothing it accepts: a schema no finite value
            # satisfies, such as {"$ref": "#"} (itself, all the way down). Answered as empty
            # content with finish_reason "stop" before this check.
            raise invalid(f"'{param}' has a JSON schema that no value can satisfy.", param=param)
        return wrapped


def _first_line(error: str) -> str:
    """llguidance's error without the grammar it quotes: for a tool, the line naming the schema's fault."""
    lines = [line for line in error.strip().splitlines() if line.strip()]
    for line in lines:
        if "JSON schema" in line or "json" in line.lower():
            return line.strip()[:500]
    return (lines[0] if lines else "unusable grammar")[:500]


class Matcher:
    """One request's grammar state. Used only on the generation thread."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab = vocab_size
        self._bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
        self.error: str | None = None

    def allowed(self) -> torch.Tensor:
        """A bool tensor over the vocabulary: True where the next token may be."""
        bits = self._bits
        self._matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        # llguidance's torch helper applies the mask with torch.compile, which on a CPU means a C++
        # toolchain and seconds of compile on first use; numpy unpacks the 1,536 words in ~20 µs.
        mask = np.unpackbits(bits.view(np.uint8), bitorder="little")[: self._vocab]
        return torch.from_numpy(mask.view(np.bool_))

    def advance(self, token: int) -> None:
        if self.error is not None or self._matcher.is_stopped():
            return  # past the end only EOS is drawn (ignore_eos keeps drawing it): nothing to consume
        if not self._matcher.consume_token(token):
            self.error = self._matcher.get_error().strip().splitlines()[0][:500] or "token refused"
