"""Turning a GGUF file into a float32 safetensors model in Hugging Face layout.

transformers reads GGUF and dequantizes it (to float32: that is what dequantized blocks are), but
refuses to `save_pretrained` a model loaded that way. So the weights are moved into a fresh model
built from the same config, with the GGUF quantization entry dropped (it would make a later load
look for a GGUF file), and that model is saved with the tokenizer and generation config.
Float32 is kept on purpose: the CPU engine computes in float32 (this class of CPU has no bf16
instructions; bf16 prompt processing is ~10x slower), and vLLM casts on load if asked.

torch and transformers are imported here, inside the function, and nowhere else in `snapshots`,
so listing or verifying snapshots never pays for them.

One parse (`_one_parse`): transformers reads a GGUF file's metadata once for the config, once for
the weights and once for the tokenizer, each time through a fresh `gguf.GGUFReader` that builds a
numpy view per metadata element (the tokenizer's vocabulary: ~440,000 of them); and it rebuilds
gguf's whole tensor-name table for every module of the model while mapping names. For the 98 MB
SmolLM2 file that was ~80 s, two thirds of it those repeats. During a conversion the reader is
shared per file and the name table memoized; both are read-only to transformers. If a later
transformers imports them differently the patch does nothing and the conversion is only slower.

The conversion's progress bar: transformers' GGUF loader draws it with `tqdm` itself, not through
`transformers.utils.logging.tqdm`, so it ignored the switch that turns transformers' bars off (which
`stoker` throws whenever stderr is not a terminal: `stoker.cli.parser.quiet_progress_bars`) and
redrew its line, carriage return after carriage return, into pipes and log files. During a
conversion the loader's `tqdm` is transformers' own, which obeys that switch; on a terminal the bar
is drawn as before.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from snapshots.errors import InvalidSource, SnapshotError

_PATCH_LOCK = threading.Lock()  # the patch is module-wide: one conversion at a time holds it


@contextlib.contextmanager
def _one_parse() -> Iterator[None]:
    import gguf
    from transformers.utils import logging as hf_logging

    try:
        from transformers import modeling_gguf_pytorch_utils as loader
    except ImportError:  # moved in a later transformers: its bar is its own business then
        loader = None
    real_reader, real_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    real_bar = getattr(loader, "tqdm", None)
    readers: dict[tuple, object] = {}

    def shared_reader(path, *args, **kwargs):
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = real_reader(path, *args, **kwargs)
        return readers[key]

    with _PATCH_LOCK:
        gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, functools.cache(real_name_map)
        if real_bar is not None:
            loader.tqdm = hf_logging.tqdm  # the bar that honours disable_progress_bar()
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_name_map
            if real_bar is not None:
                loader.tqdm = real_bar
            readers.clear()


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def convert_gguf(path: Path, out: Path) -> None:
    """Write `path` (a GGUF file) as config, float32 safetensors, tokenizer and generation config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, filename = str(path.parent), path.name
    try:
        with _one_parse():
            loaded = AutoModelForCausalLM.from_pretrained(
                directory, gguf_file=filename, dtype=torch.float32, local_files_only=True
            )
            tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename, local_files_only=True)
    except Exception as exc:  # third-party errors of every kind end here, as ours
        raise InvalidSource(f"cannot read {filename} as a GGUF model: {_one_line(exc)}") from exc

    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict(), strict=True)
        model.generation_config = loaded.generation_config
    except Exception as exc:
        raise SnapshotError(f"cannot rebuild {filename} as a safetensors model: {_one_line(exc)}") from exc
    del loaded

    try:
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    except OSError:
        raise  # disk full and the like: the store's staging turns it into StoreWriteError
    except Exception as exc:
        raise SnapshotError(f"cannot save the converted {filename}: {_one_line(exc)}") from exc
