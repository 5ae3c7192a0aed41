"""Engine.sleep / wake_up: the KV pools' device memory released (and the weights' with
``release_weights``) and rebuilt alike, so the same programs run (nothing recompiles); refused
while requests are in flight; no request and no update while asleep (``wake_up(params)``
updates and wakes)."""

from __future__ import annotations

import pytest

from minijax_serve import Engine
from tests.engine.test_engine import assert_idle_and_clean
from tests.engine.test_update_weights import CONFIG, GREEDY, tokens
from tests.engine.test_update_weights import llama_b, refs, weights  # noqa: F401 (fixtures)


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return Engine(tiny_dir["llama"], **CONFIG)


def test_sleep_releases_the_pools_and_wake_up_restores_them(engine, refs):  # noqa: F811
    prompts, ref = refs
    assert tokens(engine.generate(prompts, GREEDY)) == ref["a"]
    compiled, pools = engine.stats()["num_compilations"], (engine.runner.k_pool,
                                                          engine.runner.v_pool)
    engine.sleep()
    assert engine.is_sleeping and all(pool.is_deleted() for pool in pools)
    assert engine.prefix_cache.evictable_size == 0  # its KV is gone
    assert_idle_and_clean(engine)
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(prompts[:1], GREEDY)
    with pytest.raises(RuntimeError, match="asleep"):
        engine.sleep()
    assert engine.wake_up() == 0 and not engine.is_sleeping
    assert (engine.runner.k_pool.shape, engine.runner.k_pool.sharding) == (
        pools[0].shape, pools[0].sharding)
    outs = engine.generate(prompts, GREEDY)
    assert tokens(outs) == ref["a"] and all(o.cached_tokens == 0 for o in outs)
    assert engine.stats()["num_compilations"] == compiled
    assert_idle_and_clean(engine)
    with pytest.raises(RuntimeError, match="the engine is awake"):
        engine.wake_up()


def test_no_sleep_while_requests_are_in_flight(engine, refs):  # noqa: F811
    prompts, ref = refs
    rid = engine.add_request(prompts[0], GREEDY)
    with pytest.raises(RuntimeError, match=r"cannot sleep while requests are in flight \(1 "
                                           r"waiting, 0 running\)"):
        engine.sleep()
    engine.step()
    with pytest.raises(RuntimeError, match="0 waiting, 1 running"):
        engine.sleep()
    final = None
    while engine.has_unfinished():
        final = next((o for o in engine.step() if o.request_id == rid), final)
    assert final.token_ids == ref["a"][0] and not engine.is_sleeping
    assert_idle_and_clean(engine)


def test_no_update_while_asleep_then_wake_on_new_weights(engine, weights, refs):  # noqa: F811
    prompts, ref = refs
    engine.generate(prompts, GREEDY)  # its programs compiled, whichever tests ran before here
    version, compiled = engine.weights_version, engine.stats()["num_compilations"]
    engine.sleep(release_weights=True)
    assert engine.runner.params is None
    with pytest.raises(RuntimeError, match="update_weights: the engine is asleep"):
        engine.update_weights(weights["b"])
    with pytest.raises(RuntimeError, match="released the weights"):
        _ = engine.model
    with pytest.raises(ValueError, match="pass the weights to serve: wake_up"):
        engine.wake_up()
    with pytest.raises(ValueError, match="'final_norm' is missing"):
        engine.wake_up({"embed_tokens": weights["b"]["embed_tokens"][...]})
    assert engine.is_sleeping and engine.weights_version == version  # nothing changed
    assert engine.wake_up(weights["b"]) == version + 1
    outs = engine.generate(prompts, GREEDY)
    assert tokens(outs) == ref["b"] and {o.weights_version for o in outs} == {version + 1}
    assert engine.stats()["num_compilations"] == compiled
    engine.sleep()  # weights kept: wake on them, or on new ones
    engine.wake_up(weights["a"])
    assert tokens(engine.generate(prompts, GREEDY)) == ref["a"]
    assert_idle_and_clean(engine)
