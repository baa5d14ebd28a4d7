"""Embeddings on the CPU engine: `stoker engine --task embed` serves OpenAI's `POST /v1/embeddings`.

    {"model", "input", "encoding_format"?, "dimensions"?, "priority"?, "user"?}
      input: a string, a list of strings, a list of token ids, or a list of lists of them
      ─▶ each input's token ids (the tokenizer adds its special tokens to a string, as vLLM does)
      ─▶ one forward of the model's base (`AutoModel`: an encoder, or a decoder without its LM
         head), 32 inputs at a time, padded on the right, under one lock
      ─▶ pooled as the snapshot says (sentence-transformers' `1_Pooling/config.json`: the CLS
         token, the mean of the tokens, or the last token), mean pooling where it says nothing
      ─▶ L2-normalised, cut to `dimensions` where the model is a Matryoshka one (and normalised
         again), as floats or base64 (little-endian float32, what the `openai` client asks for)
    {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": ...}], "model",
     "usage": {"prompt_tokens": n, "total_tokens": n}}

Bounds: at most `MAX_INPUTS` (2048, OpenAI's) inputs, each at least one token and at most the
model's context (`--max-model-len`, else the model's, at most 4096): a longer one is a 400
naming it (`context_length_exceeded`), never cut short. A request is admitted as a generation is
(one of `max_num_seqs` slots; up to `max_waiting` more wait, lowest `priority` first, each at most
`queue_timeout_s`, then 503), and one admitted forward runs at a time.
An embedding engine generates nothing and loads no adapters: those routes answer 400
(`model_not_generative`), and the chat and completion routes of a generating engine answer
`/v1/embeddings` the same way (`model_not_embedding`). It has no sleep levels
(`/server_info` says `[]`): its pool stops it when idle and starts it again, from the page cache.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from stoker.errors import APIError, invalid
from stoker.spec import priority as priority_spec

if TYPE_CHECKING:
    import torch

    from stoker.engine.core import Engine

TASKS = ("generate", "embed")  # what an engine serves: `EngineConfig.task`
MAX_INPUTS = 2048  # inputs in one request, as OpenAI allows
BATCH = 32  # inputs in one forward
POOLINGS = ("mean", "cls", "last")
MAX_CONFIG_BYTES = 64 * 1024  # a pooling or model config file read from the snapshot
FORMATS = ("float", "base64")


@dataclass(frozen=True)
class EmbeddingRequest:
    model: str
    inputs: tuple[str | tuple[int, ...], ...]
    encoding_format: str = "float"
    dimensions: int | None = None
    priority: int = 0  # vLLM's: lower is admitted first


def parse_embedding_request(body: dict[str, Any]) -> EmbeddingRequest:
    """The request, checked: a 400 naming the field for anything malformed."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' is required and must be a non-empty string.", param="model")
    raw = body.get("input")
    if raw is None:
        raise invalid("'input' is required.", param="input")
    if isinstance(raw, str) or (isinstance(raw, list) and raw and all(_token(t) for t in raw)):
        items: list = [raw]  # one string, or one list of token ids
    elif isinstance(raw, list) and raw:
        items = raw
    else:
        raise invalid(
            "'input' must be a string, a list of strings, a list of token ids, or a list of lists of them.",
            param="input",
        )
    if len(items) > MAX_INPUTS:
        raise invalid(f"'input' may hold at most {MAX_INPUTS} inputs, got {len(items)}.", param="input")
    inputs: list[str | tuple[int, ...]] = []
    for i, item in enumerate(items):
        where = "input" if len(items) == 1 and item is raw else f"input[{i}]"
        if isinstance(item, str):
            if not item:
                raise invalid(f"'{where}' cannot be an empty string.", param="input")
            inputs.append(item)
        elif isinstance(item, list) and item and all(_token(t) for t in item):
            inputs.append(tuple(item))
        else:
            raise invalid(
                f"'{where}' must be a non-empty string or a non-empty list of token ids.", param="input"
            )
    encoding = body.get("encoding_format")
    encoding = "float" if encoding is None else encoding
    if encoding not in FORMATS:
        raise invalid(
            f"'encoding_format' must be 'float' or 'base64', got {encoding!r}.", param="encoding_format"
        )
    dimensions = body.get("dimensions")
    if dimensions is not None and (type(dimensions) is not int or dimensions < 1):
        raise invalid(
            f"'dimensions' must be an integer of at least 1, got {dimensions!r}.", param="dimensions"
        )
    priority = priority_spec.of_request(body.get("priority"), None, None)
    return EmbeddingRequest(model, tuple(inputs), encoding, dimensions, priority)


def _token(value: object) -> bool:
    return type(value) is int and value >= 0


def _read_json(path: Path) -> dict | None:
    """A small JSON object of the snapshot's, or None if absent; opened without following a link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise ValueError(f"{path.name} is over {MAX_CONFIG_BYTES} bytes")
    value = json.loads(data)
    if not isinstance(value, dict):
        raise ValueError(f"{path.name} is not a JSON object")
    return value


def pooling_of(snapshot_dir: Path) -> str:
    """How the snapshot says its tokens are pooled: sentence-transformers' `1_Pooling/config.json`
    (`pooling_mode_cls_token`, `pooling_mode_lasttoken`, `pooling_mode_mean_tokens`); "mean" where
    there is none. A mode this engine does not compute (max, weighted mean) is a ValueError."""
    config = _read_json(snapshot_dir / "1_Pooling" / "config.json")
    if config is None:
        return "mean"
    if config.get("pooling_mode_cls_token"):
        return "cls"
    if config.get("pooling_mode_lasttoken"):
        return "last"
    if config.get("pooling_mode_mean_tokens"):
        return "mean"
    modes = sorted(k for k, v in config.items() if k.startswith("pooling_mode_") and v)
    raise ValueError(f"the snapshot's pooling {', '.join(modes) or '(none)'} is not one this engine computes")


class Embedder:
    """One embedding model, loaded: `embed` runs one forward at a time, on a thread. (torch is
    imported where it is used: the gateway's OpenAPI schema reads this module's bounds.)"""

    def __init__(self, engine: Engine, model, tokenizer, pooling: str, matryoshka: bool) -> None:
        self._engine, self._model, self._tokenizer = engine, model, tokenizer
        self.pooling, self.matryoshka = pooling, matryoshka
        self.text_config = model.config.get_text_config()
        self.hidden_size = int(self.text_config.hidden_size)
        self.vocab = len(tokenizer)
        pad = tokenizer.pad_token_id
        self._pad = pad if pad is not None else 0
        self._lock = asyncio.Lock()

    @classmethod
    def load(cls, engine: Engine, dtype: torch.dtype) -> Embedder:
        from transformers import AutoModel, AutoTokenizer

        cfg = engine.config
        pooling = pooling_of(cfg.snapshot_dir)
        model_config = _read_json(cfg.snapshot_dir / "config.json") or {}
        matryoshka = bool(model_config.get("is_matryoshka") or model_config.get("matryoshka_dimensions"))
        tokenizer = AutoTokenizer.from_pretrained(cfg.snapshot_dir)
        model = (
            AutoModel.from_pretrained(cfg.snapshot_dir, dtype=dtype, use_safetensors=True)
            .to(cfg.device)
            .eval()
        )
        return cls(engine, model, tokenizer, pooling, matryoshka)

    def token_ids(self, req: EmbeddingRequest) -> list[list[int]]:
        """Each input's ids, checked against the vocabulary and the context (400 naming it)."""
        out, limit = [], self._engine.max_model_len
        for i, item in enumerate(req.inputs):
            where = "input" if len(req.inputs) == 1 else f"input[{i}]"
            ids = (
                list(item)
                if isinstance(item, tuple)
                else self._tokenizer.encode(item, add_special_tokens=True)
            )
            if not ids:
                raise invalid(f"'{where}' encodes to no tokens.", param="input")
            if max(ids) >= self.vocab:
                raise invalid(
                    f"'{where}' has a token id outside the vocabulary (size {self.vocab}).", param="input"
                )
            if len(ids) > limit:
                raise invalid(
                    f"This model's maximum context length is {limit} tokens; '{where}' has {len(ids)}.",
                    param="input",
                    code="context_length_exceeded",
                )
            out.append(ids)
        return out

    async def embed(self, batch: list[list[int]], dimensions: int | None, priority: int = 0) -> np.ndarray:
        """The inputs' embeddings, one row each, L2-normalised (and cut to `dimensions`); admitted
        at `priority` (lower first)."""
        if dimensions is not None and dimensions != self.hidden_size:
            if not self.matryoshka:
                raise invalid(
                    "This model does not support 'dimensions': its embeddings are not Matryoshka ones, "
                    "and cutting them would make them poor.",
                    param="dimensions",
                )
            if dimensions > self.hidden_size:
                raise invalid(
                    f"'dimensions' must be at most the model's {self.hidden_size}, got {dimensions}.",
                    param="dimensions",
                )
        engine = self._engine
        await engine._admit(priority)  # a slot, or 503 queue_full / queue_timeout, as a generation's
        try:
            async with self._lock:  # one forward at a time: the CPU's cores are one batch's
                engine.check_serving()
                vectors = await asyncio.to_thread(self._forward, batch)
        finally:
            engine._release()
        if dimensions is not None and dimensions < vectors.shape[1]:
            vectors = _normalised(vectors[:, :dimensions])
        return vectors

    def _forward(self, batch: list[list[int]]) -> np.ndarray:
        import torch

        rows = []
        device = self._engine.config.device
        with torch.inference_mode():
            for start in range(0, len(batch), BATCH):
                part = batch[start : start + BATCH]
                width = max(len(ids) for ids in part)
                ids = torch.full((len(part), width), self._pad, dtype=torch.long)
                mask = torch.zeros((len(part), width), dtype=torch.long)
                for j, row in enumerate(part):
                    ids[j, : len(row)] = torch.tensor(row)
                    mask[j, : len(row)] = 1
                ids, mask = ids.to(device), mask.to(device)
                hidden = self._model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
                rows.append(pool(hidden, mask, self.pooling).cpu().numpy())
        return _normalised(np.concatenate(rows))


def load_into(engine: Engine, dtype: torch.dtype) -> None:
    """`Engine.load` for an embedding engine: the model, its context, READY."""
    t0 = engine.clock()
    engine.embedder = Embedder.load(engine, dtype)
    limit = getattr(engine.embedder.text_config, "max_position_embeddings", None) or 4096
    engine.max_model_len = engine.config.max_model_len or min(limit, 4096)
    if engine.max_model_len > limit:
        raise ValueError(
            f"max_model_len {engine.max_model_len} exceeds the model's context of {limit} tokens"
        )
    engine.metrics.sized(engine.max_model_len)
    engine.phases["weight_load"] = engine.clock() - t0
    engine.metrics.phase("weight_load", engine.phases["weight_load"])
    engine.state = "ready"


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """One vector per row of `hidden` ([batch, tokens, width]), its padding (mask 0) left out."""
    import torch

    if pooling == "cls":
        return hidden[:, 0]
    if pooling == "last":
        last = mask.sum(dim=1) - 1  # right-padded: the last real token
        return hidden[torch.arange(hidden.shape[0]), last]
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)


def _normalised(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return (vectors / np.maximum(norms, 1e-12)).astype(np.float32)


def answer(req: EmbeddingRequest, vectors: np.ndarray, prompt_tokens: int) -> dict[str, Any]:
    """OpenAI's embedding list."""
    data = []
    for i, row in enumerate(vectors):
        if req.encoding_format == "base64":
            value: Any = base64.b64encode(row.astype("<f4").tobytes()).decode()
        else:
            value = row.tolist()
        data.append({"object": "embedding", "index": i, "embedding": value})
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    return {"object": "list", "data": data, "model": req.model, "usage": usage}


def not_generative(engine: Engine) -> APIError:
    return invalid(
        f"The model {engine.config.served_model_name!r} is an embedding model: it serves /v1/embeddings only.",
        param="model",
        code="model_not_generative",
    )


def not_embedding(engine: Engine) -> APIError:
    return invalid(
        f"The model {engine.config.served_model_name!r} generates text: it does not serve /v1/embeddings "
        "(deploy an embedding model with --task embed).",
        param="model",
        code="model_not_embedding",
    )
