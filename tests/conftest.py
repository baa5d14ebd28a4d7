"""Session fixtures shared by every test: a tiny random-weight Llama and its own small tokenizer.

The model is built here, from nothing, in a fraction of a second: 2 layers, hidden size 64, a
byte-level BPE tokenizer of 512 tokens trained on a few sentences, and a ChatML chat template.
No test downloads anything.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
STOKER = str(Path(sys.executable).with_name("stoker"))


# The files that take longest (test-seconds from `pytest --durations`, on 2 cores), slowest first.
# `make test` runs whole files on two workers (`--dist loadfile`), handed out in collection order:
# these go first, so that the two workers end together on short files instead of one of them
# starting a two-minute vLLM test when the other is nearly done. Order within a file is kept.
SLOW_FILES = (
    "tests/platform/serve/test_vllm_engine.py",
    "tests/platform/serve/test_plane_faults.py",  # six fault scenarios on the split planes, ~5 min
    "tests/platform/serve/test_reliability.py",
    "tests/platform/serve/test_serve_from_zero.py",
    "tests/platform/serve/test_revisions_live.py",
    "tests/platform/engine/test_lifecycle.py",
    "tests/platform/serve/test_sick_instance.py",
    "tests/platform/gateway/test_rate_limits.py",
    "tests/platform/serve/test_recycle_live.py",
    "tests/platform/serve/test_overload.py",  # three platforms, ~50 s
    "tests/snapshots/test_builtin_gguf.py",
    "tests/platform/api/test_openapi_fuzz.py",
    "tests/platform/serve/test_planes.py",
    "tests/platform/serve/test_planes_tls.py",
    "tests/platform/serve/test_vllm_bench_client.py",
    "tests/platform/serve/test_live_vs_simulated.py",  # a 61 s real-time trace replay, ~75 s in all
    "tests/platform/serve/test_fleet_live.py",
    "tests/platform/serve/test_compat_clients.py",
    "tests/warm_pool/test_runtime_live.py",
    "tests/kube/test_controller_e2e.py",
    "tests/platform/engine/test_wake_floor.py",
)


# What makes a test `live` (it starts processes: a platform, an engine, vLLM, moto, the CLI, a
# browser): a fixture that starts one, or a module that holds a way to start one. `make test-unit`
# runs the rest (`-m "not live"`): pure and in-process tests, loopback servers in the test's own
# process included. Marked here, at collection, so a new test file cannot forget its mark.
PROCESS_FIXTURES = frozenset(
    {
        "platform_factory",
        "shared_platform",
        "engine",
        "fresh_engine",
        "tiny_snapshot",
        "cluster",
        "pod_logs",  # a cluster of tests/kube started by the test itself (`running_cluster`)
        "planes",
        "cli",
    }
)
PROCESS_NAMES = ("subprocess", "PlatformProcess", "EngineProcess", "MotoServer", "launch_engine", "STOKER")


def starts_processes(item: pytest.Item) -> bool:
    if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    module = getattr(item, "module", None)
    return module is not None and any(name in vars(module) for name in PROCESS_NAMES)


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if starts_processes(item):
            item.add_marker(pytest.mark.live)
    rank = {path: n for n, path in enumerate(SLOW_FILES)}

    def key(indexed: tuple[int, pytest.Item]) -> tuple[int, int]:
        n, item = indexed
        return rank.get(Path(item.path).relative_to(REPO).as_posix(), len(SLOW_FILES)), n

    items[:] = [item for _, item in sorted(enumerate(items), key=key)]


@pytest.fixture(autouse=True)
def environ_restored():
    """Each test leaves `os.environ` as it found it. An in-process `stoker ... --store DIR` exports
    the store ($STOKER_SNAPSHOT_STORE, for the engines a platform starts), and the platforms and
    CLI runs of every later test on that worker inherited it: a full run sent a later test's
    `snapshot ls` and `deploy` to another test's store."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="session", autouse=True)
def nothing_left_running(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest):
    """At the session's end, what it started and did not stop is killed and named (`tests.strays`)."""
    from tests.strays import sweep

    base = tmp_path_factory.getbasetemp()
    yield
    left = sweep(base)
    if left:
        lines = "\n".join(f"  {pid}: {cmd}" for pid, cmd in sorted(left.items()))
        message = f"{len(left)} process(es) left running at the session's end, now killed:\n{lines}"
        if worker := os.environ.get("PYTEST_XDIST_WORKER"):  # for the controller's summary
            (base.parent / f"left-running-{worker}.txt").write_text(message)
        else:
            request.config.stash[LEFT_RUNNING] = message


LEFT_RUNNING = pytest.StashKey[str]()


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    messages = [config.stash.get(LEFT_RUNNING, "")]
    with contextlib.suppress(AttributeError, OSError):  # xdist: the workers' notes, in the base temp
        base = config._tmp_path_factory.getbasetemp()
        messages += [f.read_text() for f in sorted(base.glob("left-running-*.txt"))]
    if messages := [m for m in messages if m]:
        terminalreporter.write_sep("=", "left running", yellow=True)
        for message in messages:
            terminalreporter.write_line(message)


def promtool() -> str | None:
    """Prometheus's checker: on PATH, or where `make test` put it (.tools/); None where neither."""
    local = REPO / ".tools" / "promtool"
    return shutil.which("promtool") or (str(local) if os.access(local, os.X_OK) else None)


CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "Stoker holds requests while instances scale up from a warm pool.",
    "Hello, how are you today? I am fine, thank you.",
    "One two three four five six seven eight nine ten.",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_model(
    out: Path, *, max_positions: int = 2048, seed: int = 0, head_dim: int | None = None
) -> Path:
    """Write a tiny random Llama in Hugging Face layout (safetensors) to `out`. `head_dim` defaults to
    hidden / heads = 16; vLLM's CPU attention needs one of its sizes (32, 64, …)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim or 16,
        max_position_embeddings=max_positions,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, pad_token_id=fast.eos_token_id
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    fast.save_pretrained(out)
    return out


LORA_TARGETS = ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")


def build_tiny_encoder(
    out: Path, *, seed: int = 0, pooling: str = "cls", matryoshka: bool = False, hidden: int = 32
) -> Path:
    """Write a tiny random BERT encoder (safetensors, a WordPiece tokenizer) to `out`, with
    sentence-transformers' pooling config (`1_Pooling/config.json`): an embedding model. Two heads
    of `hidden` / 2 each: vLLM's CPU attention needs 32 (hidden 64)."""
    import json

    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(CORPUS * 20, trainers.WordPieceTrainer(vocab_size=400, special_tokens=specials))
    from tokenizers.processors import TemplateProcessing

    tok.post_processor = TemplateProcessing(
        single="[CLS] $A [SEP]",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]",
    )  # fmt: skip
    config = BertConfig(
        vocab_size=len(fast), hidden_size=hidden, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=2 * hidden, max_position_embeddings=128, pad_token_id=fast.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = BertModel(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    fast.save_pretrained(out)
    if matryoshka:
        data = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**data, "matryoshka_dimensions": [32, 16, 8]}))
    names = {"cls": "cls_token", "mean": "mean_tokens", "last": "lasttoken"}
    modes = {f"pooling_mode_{name}": key == pooling for key, name in names.items()}
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": hidden, **modes}))
    return out


def build_tiny_adapter(
    base: Path,
    out: Path,
    *,
    seed: int,
    rank: int = 8,
    targets: tuple[str, ...] = LORA_TARGETS,
    scale: float = 0.5,
):
    """A PEFT LoRA adapter for the model at `base`, saved to `out` as PEFT saves one; returns the
    peft model (to merge). Its lora_B is seeded random times `scale` (PEFT starts it at zero, which
    would change nothing; `scale=0` keeps that)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets)))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn_like(param) * scale)
    peft_model.save_pretrained(out)
    return peft_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model") / "tiny-llama")


@pytest.fixture(scope="session")
def stoker_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data dir for this test session; never the user's own."""
    return tmp_path_factory.mktemp("stoker-home")


@pytest.fixture(scope="session")
def stoker_env(stoker_home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["STOKER_HOME"] = str(stoker_home)
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    return env
