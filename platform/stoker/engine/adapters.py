"""LoRA adapters on the CPU engine: read from a PEFT directory at run time, chosen per request, and
mixed with each other and with the base model inside one continuous-batching step.

Reading (`read_adapter`, on a worker thread): `adapter_config.json` and `adapter_model.safetensors`
are opened through the directory's descriptor with `O_NOFOLLOW` (no link is followed, the directory's
own name included), size-bounded, and parsed by `json` and `safetensors` (a pickled
`adapter_model.bin` is refused, never unpickled). Only plain LoRA on `nn.Linear` layers is taken:
`peft_type` LORA, none of the variants that change the arithmetic (`UNSUPPORTED`), every key
`base_model.model.<module>.lora_{A,B}.weight` naming a Linear of the base (not its output head),
lora_A `r × in_features`, lora_B `out_features × r`, r at most `--max-lora-rank`. A refusal names what
is wrong: "adapter's lora_A for model.layers.0.self_attn.q_proj is 8x576, the base's layer takes 960".

Serving (`Adapters`): peft's model wrapping is not used. Each Linear some live adapter targets gets
a forward hook that adds, for the tokens of each request that uses adapter i,

    y[s:e] += scale_i · (x[s:e] @ A_iᵀ) @ B_iᵀ        (scale = lora_alpha / r, or / √r with rsLoRA)

which is what peft's merged weight `W + scale · B @ A` computes, without touching W. transformers'
`ContinuousBatchingManager` packs every running request's new tokens into one row of the step, in
the order of its `requests_in_batch`, each `query_length` tokens long. Its logits-processor list's
`prepare_tensor_args` is called with that list once per step on the generation thread, before the
forward; `install` wraps it so that `plan_step` turns the list into runs `(adapter, start, end)` of
token positions (adjacent requests of one adapter share a run; base requests have none). A step
without adapter tokens costs one Python call per hooked Linear. Hooks are added and removed in
`plan_step` too, between two forwards, never while one runs on the other thread.

Prefix sharing: transformers shares KV blocks between requests whose prompts hash alike, from the
tokens alone; a block computed under one adapter is wrong for another. `guard_prefix_cache` keeps
adapter requests out of it (they neither match nor publish blocks); base requests still share.

The LRU (`choose_victim`, pure): at most `max_adapters` loaded; loading one more evicts the least
recently used one no admitted or queued request holds (`pin`); none free is a 503 `adapters_busy`.
An unloaded or evicted adapter stays alive for the requests that hold it until they end.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import math
import os
import re
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from safetensors.torch import load as load_safetensors
from torch import nn

from stoker.engine.metrics import EngineMetrics
from stoker.errors import NOT_FOUND, SERVER_ERROR, APIError, invalid, unavailable

log = logging.getLogger("stoker.engine")

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PICKLED = "adapter_model.bin"
MAX_CONFIG_BYTES = 1 << 20
MAX_WEIGHTS_BYTES = 1 << 30  # a rank-64 adapter on every Linear of an 8B model is ~0.7 GB in fp32
KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])\.weight")
# peft options that make an adapter something other than x @ Aᵀ @ Bᵀ · scale on a Linear: refused
# when set (truthy) rather than served wrong. Options not named here do not change inference.
UNSUPPORTED = (
    "use_dora", "use_qalora", "use_bdlora", "lora_bias", "fan_in_fan_out", "modules_to_save",
    "rank_pattern", "alpha_pattern", "alora_invocation_tokens", "layer_replication",
    "target_parameters", "trainable_token_indices", "arrow_config", "kasa_config",
)  # fmt: skip


def refused(message: str) -> APIError:
    return invalid(message, param="lora_path", code="invalid_lora_adapter")


@dataclass(frozen=True)
class LoraLayer:
    a: torch.Tensor  # r × in_features
    b: torch.Tensor  # out_features × r
    scale: float


@dataclass(eq=False)
class Adapter:
    name: str
    path: str
    rank: int
    layers: dict[str, LoraLayer]  # by the base's module path
    users: int = 0  # admitted or queued requests holding it (`Adapters.pin`)


# ---- reading ---------------------------------------------------------------------------------------


def _read(dir_fd: int, name: str, limit: int) -> bytes:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        raise refused(f"the adapter has no {name}") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise refused(f"{name} is a symbolic link (links are not followed)") from None
        raise APIError(500, f"cannot open {name}: {exc.strerror or exc}", type=SERVER_ERROR) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise refused(f"{name} is not a regular file")
        if st.st_size > limit:
            raise refused(f"{name} is {st.st_size} bytes, over the bound of {limit}")
        try:
            data = f.read(limit + 1)
        except OSError as exc:
            raise APIError(500, f"cannot read {name}: {exc.strerror or exc}", type=SERVER_ERROR) from None
    if len(data) > limit:
        raise refused(f"{name} is over the bound of {limit} bytes")
    return data


def _open_dir(path: str) -> int:
    if not os.path.isabs(path):
        raise refused(f"'lora_path' must be an absolute directory path, got {path!r}")
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise APIError(
            404, f"No adapter found at {path}.", type=NOT_FOUND, param="lora_path", code="lora_not_found"
        ) from None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise refused(f"{path} is not a directory (symbolic links are not followed)") from None
        raise APIError(500, f"cannot open {path}: {exc.strerror or exc}", type=SERVER_ERROR) from None


def scale_of(config: dict, rank: int) -> float:
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise refused(f"adapter_config.json's lora_alpha must be a number, got {alpha!r}")
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def check_config(config: object, max_rank: int) -> int:
    """The adapter's rank, once its config is plain LoRA within bounds; else a 400 naming why."""
    if not isinstance(config, dict):
        raise refused("adapter_config.json must hold a JSON object")
    if config.get("peft_type") != "LORA":
        raise refused(f"only LoRA adapters are served; this one's peft_type is {config.get('peft_type')!r}")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise refused(f"adapter_config.json's r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise refused(f"the adapter's rank {rank} exceeds this engine's --max-lora-rank of {max_rank}")
    if config.get("bias", "none") != "none":
        raise refused(f"adapters with bias {config['bias']!r} are not served (only 'none')")
    if set_ := [k for k in UNSUPPORTED if config.get(k)]:
        raise refused(f"adapter_config.json sets {', '.join(set_)}, which this engine does not serve")
    return rank


def read_adapter(
    name: str, path: str, model: nn.Module, max_rank: int, device: torch.device | str, dtype: torch.dtype
) -> Adapter:
    """Read and check one PEFT LoRA adapter against `model` (blocking). Raises `APIError`."""
    dir_fd = _open_dir(path)
    try:
        try:
            config = json.loads(_read(dir_fd, CONFIG, MAX_CONFIG_BYTES))
        except (ValueError, UnicodeDecodeError) as exc:
            raise refused(f"{CONFIG} is not valid JSON: {exc}") from None
        rank = check_config(config, max_rank)
        try:
            raw = _read(dir_fd, WEIGHTS, MAX_WEIGHTS_BYTES)
        except APIError as exc:
            if exc.status == 400 and PICKLED in os.listdir(dir_fd):
                raise refused(
                    f"the adapter has only {PICKLED} (a pickle, never loaded): save it with safetensors"
                ) from None
            raise
    finally:
        os.close(dir_fd)
    try:
        tensors = load_safetensors(raw)
    except Exception as exc:  # safetensors raises its own SafetensorError, and others for odd headers
        raise refused(f"{WEIGHTS} is not a valid safetensors file: {exc}") from None
    layers = check_tensors(tensors, model, rank, scale_of(config, rank), device, dtype)
    return Adapter(name, path, rank, layers)


def check_tensors(
    tensors: dict[str, torch.Tensor],
    model: nn.Module,
    rank: int,
    scale: float,
    device: torch.device | str,
    dtype: torch.dtype,
) -> dict[str, LoraLayer]:
    """The adapter's layers, each matched against the base's Linear it names; else a 400 naming the
    first key or shape that does not fit."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = KEY.fullmatch(key)
        if match is None:
            raise refused(f"the adapter's tensor {key!r} is not a LoRA A or B weight this engine serves")
        if not tensor.is_floating_point() or tensor.dim() != 2:
            raise refused(f"the adapter's {key} is a {tensor.dtype} tensor of {tensor.dim()} dimensions")
        parts.setdefault(match["module"], {})[match["part"]] = tensor
    if not parts:
        raise refused(f"{WEIGHTS} holds no LoRA weights")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    layers = {}
    for module_path, ab in sorted(parts.items()):
        try:
            base = model.get_submodule(module_path)
        except AttributeError:
            raise refused(f"the adapter targets {module_path}, which the base model does not have") from None
        if not isinstance(base, nn.Linear) or base is head:
            raise refused(
                f"the adapter targets {module_path}, a {type(base).__name__}: only inner Linear layers"
            )
        if set(ab) != {"A", "B"}:
            raise refused(
                f"the adapter has lora_{'A' if 'A' in ab else 'B'} for {module_path} without its pair"
            )
        a, b = ab["A"], ab["B"]
        if a.shape[1] != base.in_features:
            raise refused(
                f"adapter's lora_A for {module_path} is {a.shape[0]}x{a.shape[1]}, the base's layer "
                f"takes {base.in_features}"
            )
        if b.shape[0] != base.out_features:
            raise refused(
                f"adapter's lora_B for {module_path} is {b.shape[0]}x{b.shape[1]}, the base's layer "
                f"gives {base.out_features}"
            )
        if a.shape[0] != rank or b.shape[1] != rank:
            raise refused(
                f"adapter's {module_path} has rank {a.shape[0]} (lora_A) and {b.shape[1]} (lora_B), "
                f"its config says r={rank}"
            )
        layers[module_path] = LoraLayer(
            a.to(device=device, dtype=dtype).contiguous(),
            b.to(device=device, dtype=dtype).contiguous(),
            scale,
        )
    return layers


# ---- the LRU ---------------------------------------------------------------------------------------


def choose_victim(order: Iterable[str], in_use: Callable[[str], bool], loaded: int, limit: int) -> str | None:
    """Which adapter to evict before one more loads: None while `loaded` < `limit`, else the least
    recently used (first in `order`) that nothing holds. Raises the 503 when every one is held."""
    if loaded < limit:
        return None
    for name in order:
        if not in_use(name):
            return name
    raise unavailable(
        f"All {limit} adapter slots (--max-adapters) are in use by running requests; retry shortly.",
        code="adapters_busy",
    )


# ---- serving ---------------------------------------------------------------------------------------


@dataclass
class _Step:
    runs: tuple[tuple[Adapter, int, int], ...] = ()  # (adapter, first token, one past the last)


@dataclass
class Adapters:
    """The engine's loaded adapters (LRU order), which request uses which, and the current step's
    layout. Loads, pins and bindings come from the event loop; `plan_step` and the hooks run on the
    generation thread; `_lock` guards what both touch."""

    model: nn.Module
    max_adapters: int
    max_rank: int
    metrics: EngineMetrics
    clock: Callable[[], float]
    device: torch.device | str = "cpu"
    dtype: torch.dtype = torch.float32
    loaded: OrderedDict[str, Adapter] = field(default_factory=OrderedDict)
    _by_request: dict[str, Adapter] = field(default_factory=dict)
    # Unbound, but maybe in the step that runs now: kept out of prefix sharing until a step without them
    _retired: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _step: _Step = field(default_factory=_Step)
    _hooks: dict[str, object] = field(default_factory=dict)  # module path → its hook's handle
    _dirty: bool = False  # the hooked modules may differ from what live adapters target
    _loading: asyncio.Lock = field(default_factory=asyncio.Lock)  # one load or unload at a time

    # -- event loop ------------------------------------------------------------------------------

    async def load(self, name: str, path: str, inplace: bool = False) -> None:
        """Read, check and add one adapter; a refusal or failure leaves every other one as it was."""
        async with self._loading:
            if name in self.loaded and not inplace:
                raise invalid(
                    f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
                    "in place, set 'load_inplace' to True.",
                    param="lora_name",
                )
            if self.max_adapters < 1:
                raise invalid("This engine serves no adapters (--max-adapters 0).", param="lora_name")
            if name not in self.loaded:
                self.victim()  # a 503 before reading anything when every slot is held
            t0 = self.clock()
            try:
                adapter = await asyncio.to_thread(
                    read_adapter, name, path, self.model, self.max_rank, self.device, self.dtype
                )
                evicted = self.add(adapter)
            except APIError as exc:
                self.metrics.lora_load("refused" if exc.status < 500 else "failed")
                raise
            except Exception as exc:
                log.exception("loading adapter %r from %s failed", name, path)
                self.metrics.lora_load("failed")
                raise APIError(500, f"Loading the adapter failed: {exc}", type=SERVER_ERROR) from None
            seconds = self.clock() - t0
            self.metrics.lora_load("ok", seconds)
            if evicted is not None:
                self.metrics.lora_evicted()
                log.info("adapter %r evicted (least recently used) for %r", evicted.name, name)
            self.metrics.lora_adapters(len(self.loaded))
            log.info("adapter %r loaded from %s in %.3fs (rank %d)", name, path, seconds, adapter.rank)

    async def unload(self, name: str) -> None:
        async with self._loading:
            if self.remove(name) is None:
                raise APIError(
                    404, f"The lora adapter '{name}' cannot be found.", type=NOT_FOUND, param="lora_name"
                )
            self.metrics.lora_adapters(len(self.loaded))

    def resolve(self, model: str, served: str) -> Adapter | None:
        """What a request's `model` asks for: the base (None) or a loaded adapter; else vLLM's 404."""
        if model == served:
            return None
        if (adapter := self.loaded.get(model)) is not None:
            return adapter
        raise APIError(
            404,
            f"The model `{model}` does not exist. This engine serves `{served}`"
            + (f" and the adapters {', '.join(f'`{n}`' for n in self.loaded)}." if self.loaded else "."),
            type=NOT_FOUND,
            param="model",
            code="model_not_found",
        )

    def use_model(self, model: nn.Module) -> None:
        """A new module tree for the same base (a reload on wake): hook it instead of the old one."""
        if model is self.model:
            return
        with self._lock:
            self.model, self._hooks, self._dirty = model, {}, True

    def pin(self, adapter: Adapter | None) -> None:
        if adapter is None:
            return
        adapter.users += 1
        with self._lock:
            if self.loaded.get(adapter.name) is adapter:
                self.loaded.move_to_end(adapter.name)  # the most recently used

    def unpin(self, adapter: Adapter | None) -> None:
        if adapter is None:
            return
        adapter.users -= 1
        if adapter.users == 0 and self.loaded.get(adapter.name) is not adapter:
            with self._lock:
                self._dirty = True  # unloaded while held: its hooks may go now

    def bind(self, request_id: str, adapter: Adapter) -> None:
        with self._lock:
            self._by_request[request_id] = adapter

    def unbind(self, request_id: str) -> None:
        with self._lock:
            if self._by_request.pop(request_id, None) is not None:
                self._retired.add(request_id)

    def shares_prefixes(self, request_id: str) -> bool:
        """Whether transformers may share this request's KV blocks: only a base request's."""
        return request_id not in self._by_request and request_id not in self._retired

    def victim(self) -> str | None:
        return choose_victim(
            self.loaded, lambda n: self.loaded[n].users > 0, len(self.loaded), self.max_adapters
        )

    def add(self, adapter: Adapter) -> Adapter | None:
        """Make `adapter` servable by its name, evicting first if the LRU is full; returns the evicted one."""
        # load_inplace: the new weights replace the old ones under the same name, no eviction
        name = None if adapter.name in self.loaded else self.victim()
        with self._lock:
            self.loaded.pop(adapter.name, None)
            evicted = self.loaded.pop(name) if name is not None else None
            self.loaded[adapter.name] = adapter
            self._dirty = True
        return evicted

    def remove(self, name: str) -> Adapter | None:
        with self._lock:
            adapter = self.loaded.pop(name, None)
            self._dirty = True
        return adapter

    # -- generation thread -----------------------------------------------------------------------

    def plan_step(self, requests_in_batch: list) -> None:
        """The token runs of this step's adapter requests, from transformers' packed batch order."""
        runs: list[list] = []
        position = 0
        with self._lock:
            if self._dirty:
                self._sync_hooks()
            # transformers drops cancelled requests before it schedules a step, so one retired id
            # missing from this step never runs again, nor publishes a block
            if self._retired:
                self._retired &= {future.state.request_id for future in requests_in_batch}
            for future in requests_in_batch:
                length = future.query_length
                adapter = self._by_request.get(future.state.request_id)
                if adapter is not None:
                    if runs and runs[-1][0] is adapter and runs[-1][2] == position:
                        runs[-1][2] += length
                    else:
                        runs.append([adapter, position, position + length])
                position += length
        self._step = _Step(tuple((a, s, e) for a, s, e in runs))

    def _sync_hooks(self) -> None:
        """Hook exactly the modules a loaded or still-held adapter targets (under `_lock`)."""
        live = {*self.loaded.values(), *self._by_request.values()}
        wanted = {path for adapter in live for path in adapter.layers}
        for path in set(self._hooks) - wanted:
            self._hooks.pop(path).remove()
        for path in wanted - set(self._hooks):
            self._hooks[path] = self.model.get_submodule(path).register_forward_hook(self._hook(path))
        self._dirty = False

    def _hook(self, path: str):
        def add_lora(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
            runs = self._step.runs
            if not runs:
                return output
            x = args[0].reshape(-1, module.in_features)
            y = output.view(-1, module.out_features)
            for adapter, start, end in runs:
                layer = adapter.layers.get(path)
                if layer is not None:
                    y[start:end].addmm_(x[start:end] @ layer.a.T, layer.b.T, alpha=layer.scale)
            return output

        return add_lora


def install(manager, adapters: Adapters) -> None:
    """Have `adapters.plan_step` see each step's packed batch, before its forward (see the docstring)."""
    processors = manager.logit_processor
    if getattr(processors, "_stoker_adapters", None) is adapters:
        return
    prepare = processors.prepare_tensor_args

    def prepare_tensor_args(requests_in_batch, arg_storage):
        adapters.plan_step(requests_in_batch)
        return prepare(requests_in_batch, arg_storage)

    processors.prepare_tensor_args = prepare_tensor_args
    processors._stoker_adapters = adapters


def guard_prefix_cache(cache, adapters: Adapters) -> None:
    """Keep adapter requests out of transformers' prefix sharing: their KV differs from the base's."""
    if getattr(cache, "_stoker_adapters", None) is adapters:
        return
    search, mark = cache.search_prefix_match, cache.mark_complete_blocks

    def search_prefix_match(request_id: str, prompt_ids: list[int]) -> int:
        return search(request_id, prompt_ids) if adapters.shares_prefixes(request_id) else 0

    def mark_complete_blocks(state, complete_blocks) -> None:
        if adapters.shares_prefixes(state.request_id):
            mark(state, complete_blocks)

    cache.search_prefix_match = search_prefix_match
    cache.mark_complete_blocks = mark_complete_blocks
    cache._stoker_adapters = adapters
