"""The simulated accelerator (``EngineConfig.simulate``): the unchanged scheduler driven by a cost
model, step for step as the real engine; the device timeline on the virtual clock; the cost
model's arithmetic on hand-computed cases; the pool sized from a profile; ``bench --simulate``."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time

import jax.numpy as jnp
import numpy as np
import pytest

from minijax_serve import Engine, SamplingParams
from minijax_serve.cli import main
from minijax_serve.core.clock import VirtualClock
from minijax_serve.models.config import ModelSpec, load_model_config
from minijax_serve.models.registry import resolve_model
from minijax_serve.simulate.cost_model import CostModel
from minijax_serve.simulate.profiles import H100, H200, DeviceProfile
from minijax_serve.simulate.runner import SimulatedRunner
from tests.scheduler.test_chunked_prefill import TINY
from tests.cli.test_cli import TINY as CLI_TINY, WORKLOAD
from tests.engine.test_engine import assert_idle_and_clean

TIMES = ("start_s", "host_ms", "blocked_ms")  # the only fields of a step record that may differ
# every scheduler mechanism at once, on the tiny model's CPU settings made explicit (a GPU
# profile would resolve other defaults: 8192-token chunks, unified steps)
MECHANISMS = {
    "radix+chunked+mixed+forced-retract": dict(
        page_size=16, chunked_prefill_size=32, enable_mixed_chunk=True, max_total_tokens=256,
        force_retract_every=4),
    "over-admission-retract+page-1": dict(
        page_size=1, chunked_prefill_size=48, enable_mixed_chunk=False, max_total_tokens=100,
        exact_ignore_eos_admission=False, init_new_token_ratio=0.2),
}


def _steps(engine: Engine) -> list[tuple]:
    return [tuple(v for k, v in r._asdict().items() if k not in TIMES)
            for r in engine.step_records()]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("name", list(MECHANISMS))
def test_simulated_steps_equal_the_real_engines(tiny_dir, tiny_prompts, name, overlap):
    """Same offline workload: the simulated engine schedules exactly the steps the real one ran
    (kinds, requests, tokens, buckets, queues, KV, cache hits, retracts), and leaks nothing."""
    config = dict(TINY, **MECHANISMS[name], enable_overlap=overlap, record_steps=True,
                  attention_backend="xla", dtype="float32")
    prompts = tiny_prompts + tiny_prompts[:6]  # repeats: prefix-cache hits
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    real = Engine(tiny_dir["llama"], **config)
    real_outs = real.generate(prompts, params)
    sim = Engine(tiny_dir["llama"], simulate="h200", **config)
    sim_outs = sim.generate(prompts, params)
    for engine in (real, sim):
        assert_idle_and_clean(engine)
    assert [len(o.token_ids) for o in sim_outs] == [len(o.token_ids) for o in real_outs]
    assert _steps(sim) == _steps(real)
    stats = sim.stats()
    assert stats["num_retracted"] > 0 and stats["cached_tokens"] > 0
    assert stats["num_compilations"] == 0 and sim.runner.device_time_s > 0


def _fixed_cost_runner(step_s: float) -> SimulatedRunner:
    """A runner whose every step costs ``step_s`` (a profile of launch cost only)."""
    zero = DeviceProfile(name="test", platform="gpu", memory_bytes=1e12, jax_memory_fraction=1.0,
                         matmul_flops=1e30, matmul_flops_f32=1e30, memory_bw=1e30,
                         interconnect_bw=1e30, matmul_eff=1.0, memory_eff=1.0,
                         attention_flops_eff=1.0, attention_bw_eff=1.0, launch_s=step_s,
                         allreduce_latency_s=0.0)
    cfg = load_model_config(resolve_model("qwen3-0.6b").path)
    return SimulatedRunner(CostModel(zero, cfg, "bfloat16"), VirtualClock(), 1000, (0, 1), 0)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_a_tick_costs_max_of_host_and_device_with_overlap_and_their_sum_without(tiny_dir, overlap):
    """Host and device made slow on the virtual clock (1 s of dispatch, 0.5 s of device per
    step), so the engine's real host time is noise: a run lasts steps x max(1, 0.5) s with
    overlap, steps x (1 + 0.5) s without."""
    host_s, device_s = 1.0, 0.5
    engine = Engine(tiny_dir["llama"], simulate="h200", enable_overlap=overlap, **TINY)
    runner = engine.runner
    runner.cost = _fixed_cost_runner(device_s).cost
    runner.cost.profile = dataclasses.replace(runner.cost.profile, dispatch_s=host_s)
    wall = time.perf_counter()
    outs = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=8, ignore_eos=True))
    wall = time.perf_counter() - wall  # the real host time is less than this
    stats = engine.stats()
    steps = stats["prefill_steps"] + stats["decode_steps"]
    duration = outs[0].finish_time - outs[0].arrival_time
    if overlap:  # the device keeps up: one dispatch a tick, then the last step's device time
        assert steps * host_s <= duration <= steps * host_s + device_s + wall
        assert stats["blocked_time_s"] <= device_s + wall
    else:
        assert steps * (host_s + device_s) <= duration <= steps * (host_s + device_s) + wall
        assert stats["blocked_time_s"] == pytest.approx(steps * device_s, abs=wall)
    assert runner.device_time_s == pytest.approx(steps * device_s)
    engine.check_invariants()


def test_dummy_tokens_are_never_eos():
    runner = _fixed_cost_runner(0.0)
    runner.eos = np.arange(0, 1000, 2)  # every even id is an EOS
    tokens = runner.dummy_tokens(np.arange(5000))
    assert len(set(tokens.tolist())) > 100 and not np.isin(tokens, runner.eos).any()


def test_cost_model_arithmetic_by_hand():
    """A 2-layer model, hidden 64, intermediate 128, 4 heads and 2 KV heads of 16, vocab 100,
    bfloat16, on a device of 1 TFLOP/s and 100 GB/s (halved by every efficiency), 10 µs launch."""
    cfg = dataclasses.replace(load_model_config(resolve_model("qwen3-0.6b").path),
                              hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                              num_kv_heads=2, head_dim=16, vocab_size=100, qk_norm=False)
    dev = DeviceProfile(name="test", platform="gpu", memory_bytes=1e12, jax_memory_fraction=1.0,
                        matmul_flops=1e12,
                        matmul_flops_f32=1e12, memory_bw=1e11, interconnect_bw=1e10,
                        matmul_eff=0.5, memory_eff=0.5, attention_flops_eff=0.5,
                        attention_bw_eff=0.5, launch_s=1e-5, allreduce_latency_s=2e-6)
    cost = CostModel(dev, cfg, "bfloat16")
    # layer matrices: q 64x64, k 64x32, v 64x32, o 64x64, gate/up/down 3 x 64x128 = 36864
    # decode, 4 sequences (padded 8 tokens) at 10, 20, 30, 40 keys:
    # matmul max(2*8*36864 / 0.5e12, 36864*2 / 0.5e11) = max(1.18e-6, 1.475e-6) = 1.4746e-6
    # attention: pairs 100, flops 4*4*16*100 = 25600 -> 5.12e-8; K+V bytes (100 keys + 4 new)
    #   * 2*32*2 = 13312 -> 2.6624e-7
    # head: max(2*8*6400 / 0.5e12, 6400*2 / 0.5e11) = 2.56e-7; logits 4*8*100 / 0.5e11 = 6.4e-8
    c = cost.step(8, np.array([1, 1, 1, 1, 0, 0, 0, 0]), np.array([10, 20, 30, 40, 0, 0, 0, 0]), 8)
    assert c.matmul_s == pytest.approx(2 * 1.47456e-6)
    assert c.attention_s == pytest.approx(2 * 2.6624e-7)
    assert c.head_s == pytest.approx(2.56e-7 + 6.4e-8)
    assert c.total_s == pytest.approx(2 * 1.47456e-6 + 2 * 2.6624e-7 + 3.2e-7 + 1e-5)
    assert c.allreduce_s == 0.0
    # prefill of one 512-token prompt, computed: matmul max(2*512*36864 / 0.5e12 = 7.5497e-5,
    # 1.475e-6); attention pairs 512*513/2 = 131328, flops 4*4*16*131328 / 0.5e12 = 6.7240e-5
    # vs bytes 1024*128 / 0.5e11 = 2.62e-6; head on 1 row
    p = cost.step(512, np.array([512]), np.array([512]), 1)
    assert p.matmul_s == pytest.approx(2 * 7.5497472e-5)
    assert p.attention_s == pytest.approx(2 * 6.7239936e-5)
    # tp = 2: half the matrices and heads per device, two all-reduces of 8 x 64 x 2 bytes a layer,
    # each 2e-6 + 2*(1/2)*1024 / 1e10
    t = CostModel(dev, cfg, "bfloat16", tp=2).step(8, np.array([1] * 8), np.array([10] * 8), 8)
    assert t.allreduce_s == pytest.approx(2 * 2 * (2e-6 + 1024 / 1e10))
    assert t.matmul_s == pytest.approx(2 * 36864 / 0.5e11)
    # and half the vocabulary's 64 x 100 head: max(2*8*3200 / 0.5e12, 3200*2 / 0.5e11) = 1.28e-7;
    # the embedding's all-reduce as a layer's (2.1024e-6), the logits' all-gather
    # 2e-6 + (1/2)*4*8*100 / 1e10 = 2.16e-6; the logits read 6.4e-8 as at tp = 1
    assert t.head_s == pytest.approx(1.28e-7 + 2.1024e-6 + 2.16e-6 + 6.4e-8)
    # greedy: 2 divides the vocabulary of 100, so only each device's argmax is gathered (the
    # latencies of two gathers, values and ids); with logprobs the logits are gathered whole
    g = CostModel(dev, cfg, "bfloat16", tp=2).step(8, np.array([1] * 8), np.array([10] * 8), 8,
                                                    greedy=True)
    assert g.head_s == pytest.approx(1.28e-7 + 2.1024e-6 + 4e-6 + 6.4e-8)
    lp = CostModel(dev, cfg, "bfloat16", tp=2).step(8, np.array([1] * 8), np.array([10] * 8), 8,
                                                     logprobs=True, greedy=True)
    assert lp.head_s == pytest.approx(1.28e-7 + 2.1024e-6 + 2.16e-6 + 2 * 6.4e-8)


def test_pool_from_the_profile_and_errors():
    spec = load_model_config(resolve_model("llama-3-8b").path)
    engine = Engine("llama-3-8b", simulate="h100", skip_tokenizer_init=True,
                    max_running_requests=4096)
    per_token = 2 * 32 * 8 * 128 * 2  # bfloat16 K and V of every layer
    usable = 0.75 * 80e9  # what JAX lets the engine allocate of the H100's 80 GB
    rows = 4097 * 8 * spec.vocab_size  # each slot's penalty and bias rows (and the scratch's)
    assert engine.kv_pool_tokens == pytest.approx(
        ((usable - 2 * spec.num_params()) * 0.85 - rows) / per_token, abs=16)
    assert engine.stats()["num_devices"] == 1 and jnp.dtype(engine.dtype) == jnp.bfloat16
    # tp 16 over 8 KV heads: each head (and its K/V projection) on two devices, so a device
    # holds 1/8 of a token's KV and 2/16 of the K/V weights, 1/16 of the vocabulary's
    wide = Engine("llama-3-8b", simulate="h200", skip_tokenizer_init=True,
                  max_running_requests=4096, tensor_parallel_size=16)
    embeddings = 2 * spec.vocab_size * 4096  # split by vocabulary, 128256 / 16 rows each
    norms = 32 * 2 * 4096 + 4096  # replicated
    kv_weights = 32 * 2 * 4096 * 1024
    layers = spec.num_params() - embeddings - norms + kv_weights
    free = 0.75 * 141e9 - 2 * ((layers + embeddings) / 16 + norms)
    assert wide.kv_pool_tokens == pytest.approx((free * 0.85 - rows) / (per_token / 8), abs=16)
    assert wide.stats()["num_devices"] == 16
    huge = dataclasses.replace(spec, num_layers=320)
    with pytest.raises(ValueError, match="raise tensor_parallel_size"):
        Engine(object(), simulate="h200", model_config=huge)
    with pytest.raises(ValueError, match="needs model_config= a ModelConfig"):
        Engine(object(), simulate="h200", model_config=ModelSpec(
            vocab_size=10, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8,
            max_position_embeddings=64))
    with pytest.raises(ValueError, match="simulate must be one of h200, h100, cpu"):
        Engine("llama-3-8b", simulate="tpu")
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide"):
        Engine("llama-3-8b", simulate="h200", tensor_parallel_size=3)
    assert H100.memory_bytes < H200.memory_bytes


def test_borrowed_tokenizer_text_and_lengths(smollm2_dir):
    from minijax_serve.engine.setup import load_tokenizer

    engine = Engine("llama-3-8b", simulate="h200", tokenizer=load_tokenizer(smollm2_dir))
    outs = engine.generate(["Hello there", "The capital of France is"],
                           SamplingParams(max_new_tokens=7, temperature=0.0))
    assert all(len(o.token_ids) == 7 and o.finish_reason == "length" and o.text for o in outs)
    assert all(0 < o.first_token_time - o.arrival_time < o.finish_time - o.arrival_time
               for o in outs)
    engine.check_invariants()


def test_bench_simulate(tiny_dir, tmp_path, capsys):
    out = tmp_path / "sim.jsonl"
    # qwen3-0.6b's shape (no weights are read): its decode steps on the h200 profile (~1.2 ms)
    # are a little shorter than a step's dispatch (1.33 ms), a tiny model's (µs) far shorter
    assert main(["bench", "--model", "qwen3-0.6b", *CLI_TINY, *WORKLOAD,
                 "--simulate", "h200", "--output-json", str(out),
                 "--compare", "enable_overlap=True,False"]) == 0
    printed = capsys.readouterr().out
    assert "simulated h200 x 1; virtual time" in printed and "Peak, h200 profile" in printed
    on, off = [json.loads(line) for line in out.read_text().splitlines()]
    for r in (on, off):
        assert r["simulate"] == "h200" and r["completed"] == 6 and r["device"] == "simulated h200"
        assert r["duration_s"] >= r["simulated_device_busy_s"] > 0
    assert printed.count("Simulated device busy (s):") == 2
    # Without overlap the host waits out every step it dispatched (the cost model's time);
    # with it, the next dispatch (1.3 ms on the h200 profile, longer than these decode steps)
    # runs while the step computes. The durations themselves include the host's
    # real time, so they are not compared: on a loaded machine either run can be the longer.
    assert on["mean_blocked_ms_per_step"] < off["mean_blocked_ms_per_step"] / 2
    for flags, message in ((["--baseline", "hf"], "--simulate runs no model; --baseline hf"),
                           (["--simulate", "a100"], "invalid choice: 'a100'")):
        with pytest.raises(SystemExit) if "invalid" in message else contextlib.nullcontext():
            assert main(["bench", "--model", str(tiny_dir["llama"]), *CLI_TINY, *WORKLOAD,
                         "--simulate", "h200", *flags]) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--simulate", "h200"])
    assert "unrecognized arguments: --simulate" in capsys.readouterr().err
