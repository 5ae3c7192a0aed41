"""A model of one's own through the protocol: the GPT-J/NeoX-style decoder of
``examples/parallel_decoder.py`` served with every scheduler feature gives the greedy tokens of
its own dense forward; models that break the protocol fail at construction, by name."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minijax_serve import (Engine, ModelProtocolError, ModelSpec, SamplingParams, dense_forward,
                           dense_greedy)
from tests.engine.test_engine import assert_idle_and_clean

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from parallel_decoder import ParallelConfig, ParallelDecoder  # noqa: E402

NEW = 10
SMALL = dict(max_running_requests=3, max_prefill_tokens=128, min_token_bucket=16,
             min_seq_bucket=4, min_kv_bucket=128)
WORKLOADS = {
    "page 1, radix cache": dict(page_size=1, max_total_tokens=1024),
    "page 16, chunked + mixed, retract, overlap": dict(
        page_size=16, max_total_tokens=256, chunked_prefill_size=32, enable_mixed_chunk=True,
        force_retract_every=4, enable_overlap=True),
}


@pytest.fixture(scope="module")
def model():
    return ParallelDecoder(ParallelConfig(), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def prompts():
    """Prompts that share prefixes (radix hits) and one past a chunk; the last two repeat."""
    rng = np.random.default_rng(7)
    shared = rng.integers(0, 256, 24).tolist()
    own = [rng.integers(0, 256, n).tolist() for n in (3, 9, 40, 5, 17)]
    ps = [shared + own[0], shared + own[1], own[2], shared[:8] + own[3], own[4]]
    return ps + ps[:2]


@pytest.fixture(scope="module")
def refs(model, prompts):
    return dense_greedy(model, prompts, NEW)


def test_reference_choices_are_clear_of_float32_noise(model, prompts, refs):
    longest = max(len(p) + len(r) for p, r in zip(prompts, refs))
    run = jax.jit(lambda ids: dense_forward(model, ids))
    for p, r in zip(prompts, refs):
        n = len(p) + len(r)
        logits = np.asarray(run(jnp.asarray(p + r + [0] * (longest - n))))[len(p) - 1:n - 1]
        top2 = np.sort(logits, axis=-1)[:, -2:]
        assert (top2[:, 1] - top2[:, 0]).min() > 1e-3


@pytest.mark.parametrize("workload", WORKLOADS)
def test_served_tokens_equal_the_dense_forward(model, prompts, refs, workload):
    engine = Engine(model, model_config=model.spec(), **SMALL, **WORKLOADS[workload])
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == refs
    stats = engine.stats()
    assert stats["cached_tokens"] > 0
    if engine.config.force_retract_every:
        assert stats["num_retracted"] > 0 and stats["mixed_steps"] > 0
    assert_idle_and_clean(engine)


def test_a_factory_and_a_tokenizer_free_engine(model, prompts, refs):
    engine = Engine(lambda: model, model_config=model.spec(), **SMALL, max_total_tokens=512)
    assert engine.tokenizer is None
    out = engine.generate([prompts[2]], SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert out[0].token_ids == refs[2]
    assert_idle_and_clean(engine)


class WithNotes(ParallelDecoder):
    """The example model holding a dict: its NNX graph definition does not hash."""

    def __init__(self):
        super().__init__(ParallelConfig(), rngs=nnx.Rngs(0))
        self.notes = {"source": "examples/parallel_decoder.py"}


def test_a_model_whose_graph_does_not_hash_is_served(prompts, refs):
    """Engines share programs through static arguments that hash; one whose graph definition
    does not keeps programs of its own, and serves the same tokens."""
    model = WithNotes()
    with pytest.raises(TypeError):
        hash(nnx.split(model)[0])
    engine = Engine(model, model_config=model.spec(), **SMALL, max_total_tokens=512)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == refs
    assert_idle_and_clean(engine)


# -- models that break the protocol ---------------------------------------------------------


class Broken(ParallelDecoder):
    """The example model with one fault (``fault``)."""

    def __init__(self, fault: str):
        super().__init__(ParallelConfig(num_layers=2), rngs=nnx.Rngs(0))
        self.fault = fault

    def embed(self, ids, positions):
        h = super().embed(ids, positions)
        return np.zeros(h.shape, np.float32) if self.fault == "numpy embed" else h

    def layer(self, p, h, attn):
        if self.fault == "skips attention":
            return h, attn
        if self.fault == "jnp.dot on a weight":
            return h + jnp.dot(h, p["w_o"]), attn
        h, attn = super().layer(p, h, attn)
        return (h, None) if self.fault == "drops attn" else (h, attn)

    def head(self, h, indices):
        logits = super().head(h, indices)
        if self.fault == "logits of every row":
            return super().head(h, jnp.arange(h.shape[0]))
        return logits.astype(jnp.bfloat16) if self.fault == "bfloat16 logits" else logits


@pytest.mark.parametrize("fault, message", [
    ("logits of every row", "must return logits [len(indices)=2, vocab_size=256], got a float32 array of shape (3, 256)"),
    ("bfloat16 logits", "must return float32 logits, got a bfloat16 array"),
    ("numpy embed", "model.embed(ids, positions) must return a JAX array, got a numpy.ndarray"),
    ("skips attention", "must call attn(q, k, v) exactly once, called it 0 times"),
    ("drops attn", "must return the attention object"),
    ("jnp.dot on a weight", "use it only as `x @ w`"),
])
def test_a_broken_model_fails_at_construction(fault, message):
    model = Broken(fault)
    with pytest.raises(ModelProtocolError) as err:
        Engine(model, model_config=model.spec(), **SMALL, max_total_tokens=256)
    assert message in str(err.value)


def test_wrong_layer_count_and_missing_config():
    model = ParallelDecoder(ParallelConfig(num_layers=2), rngs=nnx.Rngs(0))
    spec = ModelSpec(vocab_size=256, num_layers=3, num_heads=4, num_kv_heads=4, head_dim=16,
                     max_position_embeddings=512)
    with pytest.raises(ModelProtocolError, match="num_layers=3, but the model has 2 layers"):
        Engine(model, model_config=spec)
    with pytest.raises(ValueError, match="model_config: a model object needs a ModelSpec"):
        Engine(model)
    with pytest.raises(ValueError, match="model_config.num_kv_heads must be a positive int"):
        ModelSpec(vocab_size=256, num_layers=2, num_heads=4, num_kv_heads=0, head_dim=16,
                  max_position_embeddings=512)


def test_the_docs_example_serves_its_model():
    text = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text()
    start = text.index("class TinyLM(nnx.Module)")
    block = text[text.rindex("```python", 0, start) + len("```python"):text.index("```", start)]
    namespace: dict = {}
    exec(compile(block, "docs/models.md", "exec"), namespace)  # ends in an assert on its tokens
    namespace["engine"].check_invariants()
