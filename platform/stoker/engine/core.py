"""The engine core: one model, transformers' continuous batching, admission, sleep and wake.

Requests from the event loop enter transformers' `ContinuousBatchingManager`, which runs the
model on its own thread and batches every running request into each forward step; each new token
comes back to the loop through `register_result_handler` (`call_soon_threadsafe`). Around it:

- Admission: at most `max_num_seqs` requests generate at once; up to `max_waiting` more wait, each
  for at most `queue_timeout_s`; beyond that a request is refused at once (503, `queue_full`).
- Cancellation: leaving `generate` early (client gone, stop string) cancels the request in the
  manager, so its slot and its KV blocks are freed.
- Sampling: every request is drawn by our own processors in the manager's step (`draw.py`):
  temperature, top-p (sorting only the rows below 1), a seed, penalties, logit bias, min_tokens,
  top-k, logprobs, a response format; transformers' step ends in an argmax. A grammar is compiled
  before admission, so a schema that cannot be enforced is a 400 that holds no slot.
  `vllm:time_to_first_token_seconds` is observed when the first token reaches the event loop,
  before any byte of the answer is sent.
- LoRA adapters: loaded and unloaded at run time, each request for the base or for one of them,
  all mixed in one batch step (`adapters.py` says how); a request holds its adapter from admission on.
- Device: the CPU, or a CUDA GPU, chosen once at start (`EngineConfig.device`); everything else is
  the same code on both.
- Load: the weights are memory-mapped from the snapshot's safetensors into a model built without
  allocating any (`stoker.engine.weights`), so they load from the page cache when it is warm; on a
  GPU those mapped views are copied to the device.
- Ready: no warm-up generation on the CPU (a GPU keeps one). Load (and wake) map every page of the weights in
  (`pages.fault_in`) while the manager's thread allocates the KV cache, and report READY once
  both are done: the first request then pays for nothing the engine could have done before it.
- Sleep: the manager is stopped and the weights leave the device as `weights.sleep_plan` says:
  dropped (both levels on the CPU, level 2 on a GPU) or, level 1 on a GPU, copied to pinned host
  memory. The model's module tree, tokenizer and all imports stay. On the CPU the manager stays
  too, KV cache allocation included, its memory handed back (`_keep_manager`); on a GPU it goes.
  Wake puts the weights back (mapped again and faulted in, or one copy from pinned memory) and
  restarts the kept manager (or starts a new one) before `/wake_up` answers. Measured with
  bench/wake_bench.py: the first token after a level-1 wake costs what it costs on an engine
  that never slept (README, "Wakes at the floor").
- Kept KV (`kv_keep.py`): sleep and stop write the prefix cache's hottest blocks beside the
  snapshot in the store (`--kv-keep-bytes` at most), before the cache is reset or dropped; a start
  or wake of the same snapshot, in the same scope, maps them back before it reports READY or
  `/wake_up` answers, so a returning conversation's first request is a prefix hit.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from snapshots import pagecache
from stoker.engine import adapters as adapters_mod
from stoker.engine import draw as draw_mod
from stoker.engine import embed as embed_mod
from stoker.engine import pages, prompts, weights
from stoker.engine.adapters import Adapter, Adapters
from stoker.engine.admission import Slots
from stoker.engine.generation import PAGE_SIZE, Generation
from stoker.engine.kv_keep import KeepConfig, KvKeep
from stoker.engine.metrics import EngineMetrics, blocks
from stoker.engine.protocol import GenerationRequest, SamplingParams, sampling_defaults
from stoker.engine.structured import Grammars
from stoker.errors import invalid, unavailable

log = logging.getLogger("stoker.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# This CPU has no bf16 instructions (bf16 prompt processing is ~10x slower than fp32); GPUs compute in
# bf16 natively, and fp32 would double both the weights' memory and every copy of them.
DEFAULT_DTYPES = {"cpu": "float32", "cuda": "bfloat16"}


@dataclass(frozen=True)
class EngineConfig:
    snapshot_dir: Path
    served_model_name: str
    dtype: str = "float32"  # DEFAULT_DTYPES says why
    device: str = "cpu"  # "cpu" or "cuda": resolved from `--device auto` before this is built
    max_model_len: int | None = None  # default: the model's own, capped at 4096 for CPU speed
    max_num_seqs: int = 8
    max_waiting: int = 64
    queue_timeout_s: float = 60.0
    kv_cache_tokens: int | None = None  # default: 2 × max_model_len
    max_prefill_tokens: int = 512  # tokens per forward step; long prompts are chunked
    # Longest silence between two outputs of one request (a long prefill behind a full batch is
    # seconds on this CPU); past it the request fails rather than waiting forever.
    stall_timeout_s: float = 300.0
    max_adapters: int = 4  # LoRA adapters loaded at once (an LRU); 0: none served
    max_lora_rank: int = 64
    task: str = "generate"  # or "embed": /v1/embeddings only (`stoker.engine.embed`)
    kv_keep: KeepConfig | None = None  # where prefix blocks are kept over sleep and stop; None: nowhere

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.task not in embed_mod.TASKS:
            raise ValueError(f"task must be one of {list(embed_mod.TASKS)}, got {self.task!r}")
        if self.device not in weights.DEVICES:
            raise ValueError(f"device must be one of {list(weights.DEVICES)}, got {self.device!r}")
        for name in ("max_num_seqs", "max_prefill_tokens", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("max_waiting", "max_adapters"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be at least 0, got {getattr(self, name)}")
        for name in ("queue_timeout_s", "stall_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


class Engine:
    def __init__(
        self, config: EngineConfig, metrics: EngineMetrics, clock: Callable[[], float] = time.monotonic
    ):
        self.config = config
        self.metrics = metrics
        self.clock = clock
        self.state = "loading"  # loading → ready ⇄ sleeping; failed; stopping
        self.failure: str | None = None
        self.max_model_len = 0
        self.phases: dict[str, float] = {}
        self.sampling_defaults = sampling_defaults(config.snapshot_dir)
        self.weights_source = ""  # which path loaded the weights: weights.MMAP or weights.FROM_PRETRAINED
        self._model = None
        self._tokenizer = None
        self._manager = None
        self.embedder: embed_mod.Embedder | None = None  # an embedding engine's model
        self.adapters: Adapters | None = None  # once the model is loaded
        self._draws = draw_mod.Draws()
        # Without `kv_keep` it keeps nothing, and still counts prefix-cache queries and hits.
        self._kv_keep = KvKeep(config.kv_keep, metrics, config.dtype, config.device)
        self._grammars: Grammars | None = None
        self.vocab_size = 0  # the width of the model's logits
        self._asleep: weights.SleepPlan | None = None  # how the weights left the device, while asleep
        self._eos: set[int] = set()
        self._slots = Slots(config.max_num_seqs)  # waiters served by priority
        self.choices_admission = asyncio.Lock()  # one request of n > 1 takes its n slots at a time
        self._running = 0
        self._waiting = 0
        self._kv_used = 0  # KV blocks the running requests' tokens fill (`vllm:kv_cache_usage_perc`)
        self._kv_total = 1
        self._idle = asyncio.Event()
        self._idle.set()
        self._lifecycle = asyncio.Lock()

    # ---- loading -----------------------------------------------------------------------------------

    def load(self) -> None:
        """Load tokenizer and weights, start the batching manager and warm it up (blocking)."""
        cfg = self.config
        t0 = self.clock()
        if cfg.task == "embed":  # its model, for /v1/embeddings only
            return embed_mod.load_into(self, DTYPES[cfg.dtype])
        self._tokenizer = AutoTokenizer.from_pretrained(cfg.snapshot_dir)
        self._model, self.weights_source = weights.load_model(cfg.snapshot_dir, DTYPES[cfg.dtype], cfg.device)
        t1 = self.clock()
        model_cfg = self._model.config.get_text_config()
        limit = getattr(model_cfg, "max_position_embeddings", None) or 4096
        self.max_model_len = cfg.max_model_len or min(limit, 4096)
        if self.max_model_len > limit:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's context of {limit} tokens"
            )
        self.metrics.sized(self.max_model_len)
        if cfg.kv_cache_tokens is not None and cfg.kv_cache_tokens < self.max_model_len:
            raise ValueError(f"kv_cache_tokens must be at least max_model_len ({self.max_model_len})")
        eos = self._model.generation_config.eos_token_id
        eos = eos if eos is not None else self._tokenizer.eos_token_id
        self._eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.vocab_size = model_cfg.vocab_size
        self._draws.eos = min(self._eos, default=0)
        self._grammars = Grammars(self._tokenizer, self.vocab_size, self._eos)
        limits = (cfg.max_adapters, cfg.max_lora_rank)
        self.adapters = Adapters(
            self._model, *limits, self.metrics, self.clock, cfg.device, DTYPES[cfg.dtype]
        )
        self._start_manager()
        self._ready_to_serve()
        if cfg.device != "cpu":  # measured on the CPU only: a GPU's first kernels may still want it
            self._warm_up()
        t2 = self.clock()
        self.phases.update(weight_load=t1 - t0, warm_up=t2 - t1)
        for name, seconds in self.phases.items():
            self.metrics.phase(name, seconds)
        self.state = "ready"

    def _start_manager(self) -> None:
        gen = GenerationConfig(
            # An argmax, and none of transformers' warpers: every request's temperature, top-p and
            # draw are the draw step's (draw.py), which narrows each row to the token it drew.
            do_sample=False,
            max_new_tokens=self.max_model_len,
            eos_token_id=sorted(self._eos) or None,
            pad_token_id=next(iter(self._eos), 0),
        )
        kv_tokens = self.config.kv_cache_tokens or 2 * self.max_model_len
        self._kv_total = blocks(kv_tokens, PAGE_SIZE)
        cb = ContinuousBatchingConfig(
            per_request_processors=True,
            page_size=PAGE_SIZE,
            num_blocks=self._kv_total,
            max_batch_tokens=self.config.max_prefill_tokens,
            max_queue_size=self.config.max_num_seqs,
            q_padding_interval_size=0,  # padding serves CUDA graphs; on the CPU it only adds work
            kv_padding_interval_size=0,
            # No CUDA graphs on a GPU: transformers captures the forward, the logits processors and
            # the sampling as one graph, and the per-request draw (draw.py) reads each row's token on
            # the host, which a capture cannot replay. On the CPU there are none anyway.
            use_cuda_graph=False,
            # The draw step keeps per-request state across a step's processors and reads each row's
            # token on the host: it needs each step prepared, run and sampled in order.
            use_async_batching=False,
        )
        manager = self._model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        draw_mod.install(manager, self._draws)
        adapters_mod.install(manager, self.adapters)
        manager.start()
        self._manager = manager

    def _ready_to_serve(self) -> None:
        """What the first request would otherwise wait for, done now: the weights' pages mapped
        (`pages.fault_in`, while the manager's thread allocates the KV cache) and the manager's
        batch processor built. On the CPU that is all: measured (bench/wake_bench.py), a 2-token
        warm-up generation at load cost more than the lazy set-up it saved the first request."""
        pages.fault_in(self._model)
        deadline = time.monotonic() + 120
        while self._manager.batch_processor is None:  # set by the manager's thread once its cache exists
            if not self._manager.is_running() or time.monotonic() > deadline:
                raise RuntimeError("the engine's generation loop did not start")
            time.sleep(0.002)
        cache = self._manager.batch_processor.cache
        adapters_mod.guard_prefix_cache(cache, self.adapters)
        self._restore_kv(cache)

    def _restore_kv(self, cache) -> None:
        """The kept prefix blocks back in an empty cache (`kv_keep.py`): before READY, no request running."""
        if not self._kv_keep.attach(cache, self.adapters.shares_prefixes) or self.config.kv_keep is None:
            return
        t0 = self.clock()
        try:
            if restored := self._kv_keep.restore(cache):
                log.info("kept KV: %d prefix blocks restored in %.3fs", restored, self.clock() - t0)
        except Exception:  # a kept cache is a bonus: never worth failing a start or a wake
            log.exception("kept KV not restored")
        self.phases["kv_restore"] = self.clock() - t0
        self.metrics.phase("kv_restore", self.phases["kv_restore"])

    def _save_kv(self, processor) -> None:
        """The prefix cache's hottest blocks to the store (`kv_keep.py`), the manager stopped."""
        cache = getattr(processor, "cache", None)
        if self.config.kv_keep is None or cache is None:
            return
        if not self._kv_keep.attach(cache, self.adapters.shares_prefixes):
            return
        t0 = self.clock()
        try:
            if kept := self._kv_keep.save(cache):
                log.info("kept KV: %d prefix blocks written in %.3fs", kept, self.clock() - t0)
        except Exception:  # never worth failing a sleep or a stop
            log.exception("kept KV not written")

    def _warm_up(self) -> None:
        """One short generation, so that the first real request does not pay for lazy initialisation
        (on a GPU: cuBLAS handles, kernel loading)."""
        rid = f"warmup-{uuid.uuid4().hex[:8]}"
        ids = self._tokenizer.encode("Hello", add_special_tokens=False) or [0]
        self._manager.add_request(ids, request_id=rid, max_new_tokens=2)  # no draw of ours: greedy
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            out = self._manager.get_result(request_id=rid, timeout=0.5)
            if out is not None and out.is_finished():
                return
            if not self._manager.is_running():
                break
        raise RuntimeError("the engine did not complete its warm-up generation")

    # ---- requests ----------------------------------------------------------------------------------

    def prompt_ids(self, req: GenerationRequest) -> list[int]:
        return prompts.prompt_ids(self._tokenizer, req)

    def budget(self, prompt_tokens: int, params: SamplingParams) -> int:
        return prompts.budget(self.max_model_len, prompt_tokens, params)

    def check_serving(self) -> None:
        self.check_loop()
        if self.state == "sleeping":
            self.metrics.rejected("asleep")
            raise unavailable("The engine is asleep; wake it with POST /wake_up.", code="engine_asleep")
        if self.state != "ready":
            self.metrics.rejected(self.state)
            raise unavailable(f"The engine is not ready ({self.state}).", code=f"engine_{self.state}")

    def check_loop(self) -> None:
        """Fail the engine for good if its generation loop died while it was ready (transformers ends
        the loop's thread on any error in a step): `/health` then answers 503 and the pool replaces
        this instance, instead of routing to it requests that can only fail."""
        if self.state == "ready" and self._manager is not None and not self._manager.is_running():
            self.state = "failed"
            self.failure = "the generation loop stopped"
            log.error("the generation loop stopped; this engine is failed and serves no more requests")

    async def start(
        self, prompt_ids: list[int], params: SamplingParams, max_new: int, adapter: Adapter | None = None
    ) -> Generation:
        """Admit one request and hand it to the batching manager.

        Raises `APIError` before anything is generated when the engine cannot take it (503) or the
        request asks what the model cannot give (400: a token id beyond its vocabulary in
        `logit_bias`, a `response_format` schema that cannot be enforced), so the caller can answer
        with an error status instead of a broken stream. The returned `Generation` must be used as
        an async context manager: leaving it frees the slot and cancels generation that has not
        finished. With `adapter` (`Adapters.resolve`), it generates with that LoRA adapter.
        """
        arrival = self.clock()
        self.check_serving()
        self.adapters.pin(adapter)  # held while it waits (no eviction); the generation unpins it
        try:
            for token, _ in params.logit_bias:
                if token >= self.vocab_size:
                    raise invalid(
                        f"'logit_bias' has token id {token}, outside the vocabulary (size {self.vocab_size}).",
                        param="logit_bias",
                    )
            grammar = None
            if params.response_format is not None:  # compiled before admission: a bad schema holds no slot
                grammar = await asyncio.to_thread(self._grammars.compile, params.response_format)
            await self._admit(params.priority)
        except BaseException:
            self.adapters.unpin(adapter)
            raise
        generation = Generation(
            self, self._manager, prompt_ids, params, arrival, grammar, self.clock(), adapter
        )
        try:
            generation.submit(max_new)
        except BaseException:
            await generation.close()
            raise
        return generation

    async def _admit(self, priority: int = 0) -> None:
        if self._slots.locked():
            if self._waiting >= self.config.max_waiting:
                self.metrics.rejected("queue_full")
                raise unavailable("The engine's wait queue is full; retry shortly.", code="queue_full")
            self._waiting += 1
            self.metrics.waiting.set(self._waiting)
            try:
                async with asyncio.timeout(self.config.queue_timeout_s):
                    await self._slots.acquire(priority)
            except TimeoutError:
                self.metrics.rejected("queue_timeout")
                raise unavailable(
                    f"No generation slot became free within {self.config.queue_timeout_s:g} s.",
                    code="queue_timeout",
                ) from None
            finally:
                self._waiting -= 1
                self.metrics.waiting.set(self._waiting)
        else:
            await self._slots.acquire()
        if self.state != "ready":  # fell asleep or began stopping while we waited
            self._slots.release()
            self.check_serving()
        self._running += 1
        self._idle.clear()
        self.metrics.running.set(self._running)

    def _release(self) -> None:
        self._running -= 1
        self.metrics.running.set(self._running)
        self._slots.release()
        if self._running == 0:
            self._idle.set()

    def _kv(self, blocks_delta: int) -> None:
        self._kv_used += blocks_delta
        self.metrics.kv_blocks(self._kv_used, self._kv_total)

    def _decode(self, tokens) -> str:
        return self._tokenizer.decode(tokens, skip_special_tokens=True)

    def token_text(self, token: int) -> str:
        """One token's text as logprobs show it: special tokens included, as vLLM shows them."""
        return self._tokenizer.decode([token])

    # ---- sleep, wake, stop -------------------------------------------------------------------------

    async def sleep(self, level: int = 1, drain_timeout_s: float = 30.0) -> None:
        """Free the KV cache and take the weights off the device (`weights.sleep_plan` has the table).

        Level 1 on a GPU keeps the weights in pinned host memory; otherwise they are dropped. Level 2
        also drops the snapshot from the page cache."""
        async with self._lifecycle:
            if self.state == "sleeping":
                return
            self.check_serving()
            if self.embedder is not None:  # its /server_info says so: the pool never asks
                raise invalid("An embedding engine has no sleep mode.", param="level")
            self.state = "sleeping"  # new requests are refused from here on
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(drain_timeout_s):
                    await self._idle.wait()
            await asyncio.to_thread(self._unload, level)
            self.metrics.asleep(level)

    def _unload(self, level: int) -> None:
        plan = self._asleep = weights.sleep_plan(level, self.config.device)
        # On the CPU the manager is kept, KV cache allocation included (`_keep_manager`); in-flight
        # requests (after the drain timeout) fail either way.
        manager, processor = self._manager, self._manager.batch_processor
        manager.stop(block=True, timeout=30)  # forgets its batch processor: given back below, if kept
        stopped = not manager.is_running()  # running: the stop timed out
        if stopped:
            self._save_kv(processor)  # before the cache is reset (kept) or dropped
        keep = self.config.device == "cpu" and stopped
        if keep and self._keep_manager(processor):
            # transformers' `start` reuses a batch processor it finds (`_create_batch_processor`)
            manager.batch_processor = processor
        else:
            self._manager = None
        weights.put_to_sleep(self._model, plan)
        _trim_heap()
        if plan.drop_page_cache:
            for path in self.config.snapshot_dir.glob("*.safetensors"):
                pagecache.drop(path)

    async def wake_up(self) -> None:
        async with self._lifecycle:
            if self.state != "sleeping":
                return
            t0, from_host = self.clock(), self._asleep.to_host
            await asyncio.to_thread(self._reload)
            self.phases["wake_up"] = self.clock() - t0
            self.metrics.phase("wake_up", self.phases["wake_up"])
            self.metrics.asleep(None)
            self.state = "ready"
            if from_host:  # serving first: unpinning gigabytes of host memory need not delay the wake
                await asyncio.to_thread(weights.release_pinned)

    def _reload(self) -> None:
        cfg = self.config
        snapshot_dir, dtype, plan = cfg.snapshot_dir, DTYPES[cfg.dtype], self._asleep
        if not plan.to_host and self.weights_source != weights.MMAP:  # it needed transformers' conversions
            self._model = weights.from_pretrained(snapshot_dir, dtype, cfg.device)
        elif reason := weights.wake(self._model, plan, snapshot_dir, cfg.device):
            log.warning("weights: %s; reloading through transformers' from_pretrained instead", reason)
            self._model = weights.from_pretrained(snapshot_dir, dtype, cfg.device)
            self.weights_source = weights.FROM_PRETRAINED
        self.adapters.use_model(self._model)  # a new module tree wants its hooks again
        self._asleep = None
        manager = self._manager
        if manager is not None and manager.model is self._model:
            # `stop` put the model's own attention back: the batching one again, as transformers
            # does for a kept manager (`init_continuous_batching`).
            manager.switch_to_cb_friendly_attn(
                self._model, manager.continuous_batching_config.auto_switch_to_flash
            )
            manager.start()  # its thread resets the kept batch processor: no new KV cache
        else:
            self._start_manager()
        self._ready_to_serve()  # the weights' pages mapped before /wake_up answers, not on the first request

    def _keep_manager(self, processor) -> bool:
        """Keep the stopped manager and its batch processor over sleep, but none of the KV cache's memory.

        The cache is one tensor that transformers allocates with `torch.zeros` (380 MB for SmolLM2 at
        its default 4096-token context, 2 × that in tokens): building a new manager on wake wrote all
        of it again before the first token (0.2-0.5 s on this CPU). Kept, its pages go back to the OS
        (`pages.release_pages`) and read as zeros when next touched, which is what a new cache
        holds; only the blocks requests then write come back. Every block is freed and the prefix
        hashes forgotten (`cache.reset`), so no request after the wake matches a block that now reads
        zeros. False (the caller drops the manager) when this transformers' cache has another shape.
        """
        cache = getattr(processor, "cache", None)
        tensor = getattr(cache, "cache_tensor", None)
        if not isinstance(tensor, torch.Tensor) or not callable(getattr(cache, "reset", None)):
            return False
        cache.reset()
        pages.release_pages(tensor)
        return True

    def shutdown(self) -> None:
        self.state = "stopping"
        if self._manager is not None:
            processor = self._manager.batch_processor
            if self._manager.is_running():  # not when asleep: a kept manager is stopped already
                self._manager.stop(block=True, timeout=10)
                if not self._manager.is_running():
                    self._save_kv(processor)  # asleep: saved by the sleep, and the cache is empty now
            self._manager = None


def _trim_heap() -> None:
    """Hand freed heap pages back to the OS so that sleep shows in the process's RSS (glibc only)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
