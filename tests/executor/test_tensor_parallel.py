"""Tensor parallelism on forced CPU devices (a subprocess with 4 of them): greedy tokens equal to
HuggingFace for tp = 2, 3 and 4 (KV heads split, and replicated when tp exceeds them; the
vocabulary split, and padded when tp does not divide it) with the
radix cache, chunked + mixed prefill, forced retracts and overlap; one case on Pallas, one with
speculative decoding (a draft model on the same mesh); seeded
samples equal to tp = 1 (on logits split by vocabulary); grammars' tokens equal to HF under
llguidance's masks (on split logits); weights and KV split 1/tp per device; a step's logits
gathered only where tp does not divide the vocabulary; clear errors."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from minijax_serve import Engine
from minijax_serve.executor.tensor_parallel import kv_replicas
from minijax_serve.models.config import ModelSpec
from tests import hf_reference
from tests.frontend.test_structured_output import GRAMMAR_FIELDS, GRAMMARS, reference

ROOT = Path(__file__).resolve().parents[2]
NEW = 8
# one token bucket for chunks and mixed steps (the chunk's 32; the bucket ladder is tested at
# tp = 1): each case compiles 3 step programs instead of 5 (the worker 83 -> 77 s cold)
BUSY = dict(page_size=16, chunked_prefill_size=32, enable_mixed_chunk=True, max_total_tokens=256,
            force_retract_every=4, max_running_requests=3, max_prefill_tokens=128,
            min_token_bucket=32, min_seq_bucket=4, min_kv_bucket=128)


def save_gqa_llama(path: Path, vocab_size: int, tied: bool, seed: int = 3) -> Path:
    """A Llama with 4 heads and 2 KV heads."""
    import torch
    import transformers as tf

    config = tf.LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                            num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                            max_position_embeddings=128, initializer_range=0.25, rms_norm_eps=1e-6,
                            tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(8.0)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gqa_llama(tmp_path_factory):
    """At tp = 4 each KV head lives on two devices; its tied vocabulary of 301 is padded to 304
    there."""
    return save_gqa_llama(tmp_path_factory.mktemp("gqa_llama"), 301, tied=True)


@pytest.fixture(scope="module")
def gqa_llama_b(tmp_path_factory):
    """The same architecture with other weights: what an update serves."""
    return save_gqa_llama(tmp_path_factory.mktemp("gqa_llama_b"), 301, tied=True, seed=4)


@pytest.fixture(scope="module")
def even_llama(tmp_path_factory):
    """A vocabulary of 304, untied, that tp = 2 splits: the logits leave the step split."""
    return save_gqa_llama(tmp_path_factory.mktemp("even_llama"), 304, tied=False)


@pytest.fixture(scope="module")
def even_llama_tokenizer(even_llama, tmp_path_factory):
    """The even Llama with the byte-fallback tokenizer (301 tokens of its 304), for grammars."""
    from tests.frontend.test_detokenizer import byte_fallback_tokenizer

    path = tmp_path_factory.mktemp("even_llama_tokenizer") / "llama"
    shutil.copytree(even_llama, path)
    byte_fallback_tokenizer().save_pretrained(path)
    return path


def run_worker(tmp_path, prompts, cases) -> dict:
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps({"prompts": prompts, "new": NEW, "cases": cases}))
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"
    env = {**os.environ, "XLA_FLAGS": flags.strip(), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "tp_worker.py"), str(spec)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_tp_tokens_equal_hf(tiny_dir, gqa_llama, gqa_llama_b, even_llama, even_llama_tokenizer,
                            smollm2_dir, hf_smollm2, tiny_prompts, tmp_path):
    prompts = tiny_prompts[::3] + tiny_prompts[-2:]
    models = {"llama": tiny_dir["llama"], "qwen3": tiny_dir["qwen3"],
              "mistral": tiny_dir["mistral"], "gqa-llama": gqa_llama, "even-llama": even_llama,
              "even-llama-tokenizer": even_llama_tokenizer, "smollm2": smollm2_dir}
    cases = [
        dict(name="llama tp4", model="llama", tp=4, config=BUSY),
        dict(name="qwen3 tp2", model="qwen3", tp=2, config=BUSY),
        dict(name="llama tp2, a large pool", model="llama", tp=2, check_memory=True,
             config=dict(BUSY, max_total_tokens=65536, chunked_prefill_size=-1,
                         enable_mixed_chunk=False)),
        dict(name="mistral tp2", model="mistral", tp=2, config=BUSY),
        dict(name="gqa-llama tp4 (KV heads replicated, tied vocabulary padded)",
             model="gqa-llama", tp=4, config=BUSY, update=str(gqa_llama_b)),
        dict(name="llama tp2 speculative (a self-draft of one layer)", model="llama", tp=2,
             config=dict(BUSY, speculative_method="draft", speculative_draft_layers=1)),
        dict(name="llama tp2 pallas", model="llama", tp=2,
             config=dict(BUSY, attention_backend="pallas", force_retract_every=0)),
        dict(name="SmolLM2 tp3 (9 heads, 3 KV heads)", model="smollm2", tp=3,
             config=dict(BUSY, max_total_tokens=512, min_token_bucket=64)),
        dict(name="seeded tp1", model="mistral", tp=1, config=BUSY, seeded=True),
        dict(name="seeded tp2 (vocabulary padded)", model="mistral", tp=2, config=BUSY,
             seeded=True),
        dict(name="features tp1", model="even-llama", tp=1, config=BUSY, features=True),
        dict(name="features tp2 (logits split by vocabulary)", model="even-llama", tp=2,
             config=BUSY, features=True),
        dict(name="grammars tp2 (logits split by vocabulary)", model="even-llama-tokenizer",
             tp=2, config=BUSY, params=GRAMMAR_FIELDS),
    ]
    for case in cases:
        case["model"] = str(models[case["model"]])
    got = run_worker(tmp_path, prompts, cases)
    for case in cases:
        if case.get("seeded") or case.get("features") or case.get("params"):
            continue
        hf = hf_smollm2 if case["model"] == str(smollm2_dir) else None
        ref = hf_reference.greedy(Path(case["model"]), prompts, NEW, model=hf)
        if case.get("update"):  # then the weights of another model, updated in place
            got[case["name"]], updated = got[case["name"]]
            assert updated == hf_reference.greedy(Path(case["update"]), prompts, NEW)
        assert got[case["name"]] == ref, case["name"]
    assert got["seeded tp2 (vocabulary padded)"] == got["seeded tp1"]
    assert got["seeded tp1"] != hf_reference.greedy(models["mistral"], prompts, NEW)
    single, split = got["features tp1"], got["features tp2 (logits split by vocabulary)"]
    assert [s[0] for s in split] == [s[0] for s in single]  # the tokens
    assert_close(split, single)  # logprobs: the devices sum the logits in another order
    assert single[0][0] != hf_reference.greedy(models["even-llama"], prompts[:1], NEW)[0]
    assert got["grammars tp2 (logits split by vocabulary)"] == grammar_references(
        even_llama_tokenizer, prompts)


def grammar_references(model_dir: Path, prompts: list) -> list:
    """Each prompt's tokens under ``GRAMMARS`` (taken in turn) on HF and llguidance's matcher."""
    from transformers import AutoTokenizer

    hf = hf_reference.load_hf(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos = hf.config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos)
    refs = []
    for prompt, params in zip(prompts, itertools.cycle(GRAMMARS)):
        if params.grammar is None:
            refs += hf_reference.greedy(model_dir, [prompt], params.max_new_tokens, model=hf)
        else:
            refs.append(reference(hf, tokenizer, hf.config.vocab_size, eos, prompt, params))
    return refs


def assert_close(a, b) -> None:
    """Equal structures, numbers within 1e-4 (the tolerance of logprobs against HF's)."""
    if isinstance(a, float) or isinstance(b, float):
        assert a == pytest.approx(b, rel=0, abs=1e-4)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_close(a[key], b[key])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_close(x, y)
    else:
        assert a == b


def test_head_counts_tp_cannot_split():
    spec = lambda heads, kv: ModelSpec(vocab_size=8, num_layers=1, num_heads=heads,  # noqa: E731
                                      num_kv_heads=kv, head_dim=4, max_position_embeddings=8)
    assert kv_replicas(spec(8, 8), 4) == 1 and kv_replicas(spec(8, 2), 4) == 2
    with pytest.raises(ValueError, match="tensor_parallel_size=4 does not divide num_heads=6"):
        kv_replicas(spec(6, 2), 4)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 and num_kv_heads=3"):
        kv_replicas(spec(6, 3), 2)


def test_tp_beyond_the_devices(tiny_dir):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=64 exceeds the \d+ devices"):
        Engine(tiny_dir["llama"], tensor_parallel_size=64, skip_tokenizer_init=True,
               max_total_tokens=256)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_processes(tmp_path, model_dir, prompts, disagree: bool) -> list[str]:
    case = tmp_path / f"case_{disagree}.json"
    case.write_text(json.dumps({"prompts": prompts, "new": NEW, "disagree": disagree}))
    coordinator = f"127.0.0.1:{_free_port()}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "tp_process_worker.py"),
                               coordinator, str(i), str(model_dir), str(case)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for i in range(2)]
    outs = []
    try:
        for i, p in enumerate(procs):
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-4000:]
            result = Path(f"{case}.{i}")
            assert result.is_file(), out[-4000:] + err[-4000:]
            outs.append(result.read_text())
    finally:
        for p in procs:
            p.kill()
    return outs


def test_two_processes_share_one_mesh(even_llama, tiny_prompts, tmp_path):
    """The logits split by vocabulary across the processes (each holds half)."""
    prompts = tiny_prompts[::4]
    ref = hf_reference.greedy(even_llama, prompts, NEW)
    outs = run_two_processes(tmp_path, even_llama, prompts, disagree=False)
    assert [json.loads(o) for o in outs] == [ref, ref]
    assert run_two_processes(tmp_path, even_llama, prompts, disagree=True) == [
        "AGREEMENT_ERROR"] * 2
