"""The served model for training (engine.model): a plain NNX module over the engine's own
arrays whose full-sequence log-probabilities are the engine's; a gradient step on it, served
through update_weights, gives the greedy tokens of the model's own dense forward, for the
built-in decoder and for a model of one's own, with nothing recompiled."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from minijax_serve import Engine, SamplingParams, dense_greedy
from minijax_serve.models.training import token_logprobs
from tests.engine.test_engine import assert_idle_and_clean
from tests.engine.test_update_weights import CONFIG
from tests.models.test_own_model import SMALL, WORKLOADS, ParallelConfig, ParallelDecoder

NEW = 8


def train(model: nnx.Module, target: jax.Array, steps: int = 3) -> list[float]:
    """Adam steps raising the likelihood of the sequence ``target`` [1, T]; the losses."""
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        loss, grads = nnx.value_and_grad(lambda m: -token_logprobs(m, target).mean())(model)
        optimizer.update(model, grads)
        return loss

    return [float(step(model, optimizer)) for _ in range(steps)]


def check_train_then_serve(engine: Engine, prompts: list[list[int]]) -> None:
    greedy = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    before = [o.token_ids for o in engine.generate(prompts, greedy)]
    compiled = engine.stats()["num_compilations"]
    model = engine.model
    pointers = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(nnx.state(model))]
    assert pointers == [p.unsafe_buffer_pointer() for p in engine.runner.params]  # no copy
    target = jnp.array([prompts[0] + [7] * NEW])  # teach it to answer 7s
    losses = train(model, target)
    assert losses[-1] < losses[0]
    assert [p.unsafe_buffer_pointer() for p in engine.runner.params] == pointers  # untouched
    engine.update_weights(nnx.state(model))
    after = [o.token_ids for o in engine.generate(prompts, greedy)]
    assert after == dense_greedy(model, prompts, NEW) != before
    assert engine.stats()["num_compilations"] == compiled
    assert_idle_and_clean(engine)


def test_logprobs_of_the_training_forward_are_the_engines(tiny_dir, tiny_prompts):
    engine = Engine(tiny_dir["llama"], **CONFIG)
    prompts = tiny_prompts[3:6]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True,
                                                   logprobs=0))
    longest = max(len(p) for p in prompts) + NEW
    ids = [p + o.token_ids + [0] * (longest - len(p) - NEW) for p, o in zip(prompts, outs)]
    lps = np.asarray(nnx.jit(token_logprobs)(engine.model, jnp.array(ids)))
    for row, prompt, out in zip(lps, prompts, outs):
        served = [lp[t] for t, lp in zip(out.token_ids, out.logprobs)]
        np.testing.assert_allclose(row[len(prompt) - 1:len(prompt) - 1 + NEW], served,
                                   rtol=0, atol=1e-4)
    check_train_then_serve(engine, prompts)


def test_a_model_of_ones_own_trains_and_serves(tiny_prompts):
    model = ParallelDecoder(ParallelConfig(), rngs=nnx.Rngs(0))  # test_own_model's programs
    engine = Engine(model, model_config=model.spec(), **WORKLOADS["page 1, radix cache"],
                    **SMALL)
    check_train_then_serve(engine, tiny_prompts[3:6])
    with pytest.raises(ValueError, match="only the built-in decoder family loads weights"):
        engine.update_weights_from_disk("/nowhere")
