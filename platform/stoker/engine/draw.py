"""Per-request greedy decoding and seeded sampling inside transformers' continuous batching.

transformers' continuous batching applies temperature and top-p per request, but chooses between
sampling and argmax once for the whole manager, and seeds one global generator. OpenAI's API asks
for both per request: `temperature: 0` is greedy, `seed: N` makes a sampled answer repeatable
whatever else shares the batch. This processor runs last in transformers' own logits-processor
list (after its temperature and top-p warpers) and, for the rows that need it, narrows the
distribution to a single token: the argmax for greedy rows, a draw from that row's own
`torch.Generator` for seeded rows. transformers' sampler then draws from a one-token distribution,
which is that token. Rows with neither are left to transformers' sampler untouched.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessor

GREEDY_TEMPERATURE = 1.0  # what transformers' warper gets for greedy rows: harmless, the argmax ignores it


@dataclass
class _Draw:
    greedy: bool
    generator: torch.Generator | None


class PerRequestDraw(ContinuousBatchingLogitsProcessor):
    supported_kwargs: dict[str, type] = {}  # noqa: RUF012 (the ABC declares these as class attributes)
    ignored_kwargs: tuple[str, ...] = ()

    def __init__(self, device: str = "cpu") -> None:
        self._device = device  # where the scores are: a generator must live on the same device
        self._draws: dict[str, _Draw] = {}
        self._rows: list[_Draw | None] = []
        self._lock = threading.Lock()  # requests are registered from the event loop, used on the CB thread

    def register(self, request_id: str, *, greedy: bool, seed: int | None) -> None:
        if not greedy and seed is None:
            return
        generator = None
        if not greedy:
            generator = torch.Generator(device=self._device)
            generator.manual_seed(seed % 2**64)
        with self._lock:
            self._draws[request_id] = _Draw(greedy, generator)

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._draws.pop(request_id, None)

    # -- called by transformers on its generation thread, prepare then call, once per step ---------------

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(0)

    def prepare_tensor_args(self, requests_with_new_token: list) -> torch.Tensor:
        with self._lock:
            self._rows = [self._draws.get(r.state.request_id) for r in requests_with_new_token]
        return torch.zeros(len(requests_with_new_token), dtype=torch.int32)

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        for row, draw in enumerate(self._rows[: scores.size(0)]):
            if draw is None:
                continue
            if draw.greedy:
                token = int(torch.argmax(scores[row]))
            else:
                probs = torch.softmax(scores[row], dim=-1)
                token = int(torch.multinomial(probs, 1, generator=draw.generator))
            keep = scores[row, token].clone()
            scores[row].fill_(-float("inf"))
            scores[row, token] = keep
        return scores


def install(manager, draw: PerRequestDraw) -> None:
    """Append `draw` to the continuous-batching manager's logits processors, before it starts.

    transformers sizes one row of per-request arguments for each per-request processor it built
    itself; ours gets a row too, so the bookkeeping below mirrors what its constructor does.
    """
    processors = manager.logit_processor
    processors.logits_processor.append(draw)
    processors.tensors_required += 1
    processors.do_processing = True
