"""Log-probabilities: what the draw step records for each generated token, and OpenAI's two shapes.

Which distribution: vLLM's default (`logprobs_mode="raw_logprobs"`, unchanged in 0.32): the
log-softmax of the model's logits after the structured-output mask and before anything else
(logit bias, min_tokens, penalties, temperature, top-k, top-p). So a token forced by
`logit_bias: +100` reports the probability the model gave it, and a token the grammar forbids
reports -inf, written -9999.0 as vLLM and OpenAI write it (JSON has no infinity).

Shapes: chat's `choices[].logprobs = {"content": [{token, logprob, bytes, top_logprobs: [...]}]}`
with `top_logprobs` the N most likely tokens by rank (OpenAI's meaning; vLLM lists the chosen token
first when it falls outside the top N, which we do not copy); the legacy completions'
`{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}` where each
`top_logprobs` entry holds the chosen token and the N most likely (N or N + 1 entries, as OpenAI
documents). Token text is `tokenizer.decode([id])` and `bytes` its UTF-8, as vLLM does (a token
that is part of a multi-byte character reads as U+FFFD there too). There is one entry per
generated token, the EOS token included, so an answer has `usage.completion_tokens` of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

FLOOR = -9999.0  # what -inf is written as


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob) of the N most likely, best first


def _lp(x: float) -> float:
    return max(x, FLOOR)


def chat_content(records: Sequence[TokenLogprob], text_of: Callable[[int], str]) -> list[dict]:
    """Chat's `logprobs.content` entries for `records`."""

    def entry(token: int, logprob: float) -> dict:
        text = text_of(token)
        return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode("utf-8", "replace"))}

    return [{**entry(r.token, r.logprob), "top_logprobs": [entry(t, lp) for t, lp in r.top]} for r in records]


class LegacyLogprobs:
    """The completions API's logprobs, built chunk by chunk: `text_offset` runs on across chunks, so
    a stream's offsets are the whole answer's."""

    def __init__(self, text_of: Callable[[int], str]) -> None:
        self._text_of = text_of
        self._offset = 0

    def block(self, records: Sequence[TokenLogprob]) -> dict:
        tokens, logprobs, tops, offsets = [], [], [], []
        for r in records:
            text = self._text_of(r.token)
            tokens.append(text)
            logprobs.append(_lp(r.logprob))
            top = {text: _lp(r.logprob)}
            for t, lp in r.top:
                top.setdefault(self._text_of(t), _lp(lp))
            tops.append(top)
            offsets.append(self._offset)
            self._offset += len(text)
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}
