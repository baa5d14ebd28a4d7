"""`stoker snapshot import FILE.gguf` draws the conversion's progress bar on a terminal only.

transformers' GGUF loader draws "Converting and de-quantizing GGUF tensors" with `tqdm` itself,
past the switch `stoker` turns off when stderr is not a terminal; piped (`2>&1 | cat`, CI logs) it
filled the output with carriage-return frames. The GGUF here is the suite's tiny random Llama
(`build_tiny_model`) written by `gguf.GGUFWriter` as llama.cpp's converter would: 400 KB, a
conversion in about a second, where the builtin SmolLM2 takes half a minute.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from tests.conftest import build_tiny_model
from tests.deadlines import CLI
from tests.snapshots.support import RunCLI

BAR = "Converting and de-quantizing GGUF tensors"

# Hugging Face module names -> GGUF tensor names, per layer (llama.cpp's `convert_hf_to_gguf.py`).
LAYER_TENSORS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_tiny_gguf(src: Path, out: Path) -> Path:
    """The HF-layout tiny Llama at `src` as a float32 GGUF file (byte-level BPE tokenizer)."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    config = json.loads((src / "config.json").read_text())
    tokenizer = json.loads((src / "tokenizer.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]

    def rotary_layout(w: np.ndarray, n: int) -> np.ndarray:  # llama.cpp's permute; transformers undoes it
        return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    added = {t["id"]: t["content"] for t in tokenizer["added_tokens"]}
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda item: item[1])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([added.get(i, token) for token, i in vocab])
    writer.add_token_types(
        [gguf.TokenType.CONTROL if i in added else gguf.TokenType.NORMAL for _, i in vocab]
    )
    merges = tokenizer["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    for name, w in load_file(str(src / "model.safetensors")).items():
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        else:  # model.layers.<i>.<module>.weight
            _, _, layer, *module, _ = name.split(".")
            gguf_name = f"blk.{layer}.{LAYER_TENSORS['.'.join(module)]}.weight"
        if name.endswith("q_proj.weight"):
            w = rotary_layout(w, heads)
        elif name.endswith("k_proj.weight"):
            w = rotary_layout(w, kv_heads)
        writer.add_tensor(gguf_name, np.ascontiguousarray(w, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny-gguf")
    return write_tiny_gguf(build_tiny_model(root / "hf"), root / "tiny.gguf")


@pytest.fixture
def bars_by_default(home_env: dict[str, str]) -> dict[str, str]:
    """The environment with no progress-bar choice of the user's: what `stoker` decides is tested."""
    for name in ("HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE"):
        home_env.pop(name, None)
    return home_env


def test_no_progress_bar_when_stderr_is_a_pipe(cli: RunCLI, tiny_gguf: Path, bars_by_default) -> None:
    proc = cli("import", str(tiny_gguf), "--name", "tiny-gguf", timeout=CLI)
    assert proc.returncode == 0, proc.stderr
    assert "converting tiny.gguf" in proc.stderr  # a conversion ran (nothing reused)
    assert "\r" not in proc.stderr and "%|" not in proc.stderr, proc.stderr


def test_the_progress_bar_is_drawn_on_a_terminal(tiny_gguf: Path, bars_by_default) -> None:
    """The other half of the promise: with stderr on a terminal the bar is there."""
    master, terminal = pty.openpty()
    fcntl.ioctl(
        terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0)
    )  # tqdm draws 0 columns wide otherwise
    cmd = [
        sys.executable,
        "-m",
        "stoker.cli.main",
        "snapshot",
        "import",
        str(tiny_gguf),
        "--name",
        "tiny-gguf",
    ]
    proc = subprocess.Popen(
        cmd, env=bars_by_default, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=terminal
    )
    os.close(terminal)
    stderr, deadline = b"", time.monotonic() + CLI
    try:
        while (left := deadline - time.monotonic()) > 0:
            if not select.select([master], [], [], left)[0]:
                break
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the process closed its end
                break
            if not chunk:
                break
            stderr += chunk
        assert proc.wait(timeout=max(1.0, deadline - time.monotonic())) == 0, stderr
    finally:
        proc.kill()
        proc.wait()
        os.close(master)
        proc.stdout.close()
    text = stderr.decode(errors="replace")
    assert BAR in text and "%|" in text, text
