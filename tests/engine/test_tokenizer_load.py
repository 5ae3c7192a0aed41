"""``load_tokenizer`` takes a ``PreTrainedTokenizerFast`` directory without AutoTokenizer (whose
model-config path imports torch): the same tokenizer AutoTokenizer makes, and no torch in the
process; other classes still go through AutoTokenizer."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from minijax_serve.engine.setup import FAST_TOKENIZER_CLASSES, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["The capital of France is", "the cat 😀 saw 世界 and 中文 naïve über 🎉 π!", " a\n\tb  ",
         "<|im_start|>user\nhi<|im_end|>"]
CHAT = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"}]


def assert_same_tokenizer(ours, theirs) -> None:
    assert type(ours) is type(theirs)
    assert ours.get_vocab() == theirs.get_vocab() and len(ours) == len(theirs)
    assert ours.all_special_ids == theirs.all_special_ids
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(ours, name) == getattr(theirs, name), name
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert (ours.decode(ids, skip_special_tokens=skip)
                        == theirs.decode(ids, skip_special_tokens=skip))
    assert ours.chat_template == theirs.chat_template
    if ours.chat_template:
        assert (ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
                == theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True))


def tokenizer_class(path: Path) -> str:
    return json.loads((path / "tokenizer_config.json").read_text())["tokenizer_class"]


def test_a_fast_tokenizer_is_autotokenizers(smollm2_dir, tiny_server_dir):
    for path in (Path(smollm2_dir), Path(tiny_server_dir)):  # SmolLM2's; a byte-fallback one
        assert tokenizer_class(path) in FAST_TOKENIZER_CLASSES
        assert_same_tokenizer(load_tokenizer(path), AutoTokenizer.from_pretrained(path))


def test_another_class_goes_through_autotokenizer(smollm2_dir, tmp_path):
    path = tmp_path / "gpt2_class"
    shutil.copytree(smollm2_dir, path, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(
        dict(config, tokenizer_class="GPT2Tokenizer")))
    ours, theirs = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert type(ours).__name__ == type(theirs).__name__ == "GPT2Tokenizer"
    assert_same_tokenizer(ours, theirs)


def test_loading_a_fast_tokenizer_imports_no_torch(smollm2_dir):
    code = ("import sys; from pathlib import Path; "
            "from minijax_serve.engine.setup import load_tokenizer; "
            f"load_tokenizer(Path({str(smollm2_dir)!r})); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


@pytest.mark.parametrize("text", ["{", '{"tokenizer_class": 3}', "[]"])
def test_an_unreadable_config_is_an_error_naming_the_file(text, tiny_server_dir, tmp_path):
    path = tmp_path / "bad"
    shutil.copytree(tiny_server_dir, path, ignore=shutil.ignore_patterns("*.safetensors"))
    (path / "tokenizer_config.json").write_text(text)
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        load_tokenizer(path)
