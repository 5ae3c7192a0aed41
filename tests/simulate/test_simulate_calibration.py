"""The simulator's calibration: step device times read from an overlapped trace, the profile fit,
a run kept as data, and the H200 profile against the real run it was fitted to
(benchmarks/data/h200_peer_llama.jsonl.gz: its step times per group within 10 %, the whole run
replayed on the simulator within 5 %)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from minijax_serve.models.config import load_model_config
from minijax_serve.models.registry import resolve_model
from minijax_serve.simulate.calibration import (
    StepSet, TimedSteps, fit_profile, group_errors, overlapped_step_times, predicted_times,
    step_group)
from minijax_serve.simulate.cost_model import CostModel, StepLoad, step_load
from minijax_serve.simulate.profiles import H200
from minijax_serve.bench.replay import replay
from minijax_serve.simulate.recorded_run import (SCHEDULE, prefix_parents, read_recorded_run,
                                                 synthetic_prompts, timed_steps,
                                                 write_recorded_run)

DATA = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "h200_peer_llama.jsonl.gz"


@pytest.fixture(scope="module")
def llama():
    return load_model_config(resolve_model("llama-3-8b").path)


def test_step_load_sums_and_the_per_sequence_and_per_layer_costs(llama):
    # two decodes at 10 and 20 keys, a chunk of 3 tokens ending at 5 keys, one padding sequence
    load = step_load(8, np.array([1, 1, 3, 0]), np.array([10, 20, 5, 0]), 4)
    assert load == StepLoad(8, 3, 5, 35, 10 + 20 + (15 - 3), 4)
    base = CostModel(dataclasses.replace(H200, attention_seq_s=0.0, layer_s=0.0), llama,
                     "bfloat16").cost(load)
    more = CostModel(dataclasses.replace(H200, attention_seq_s=1e-6, layer_s=1e-5), llama,
                     "bfloat16").cost(load)
    layers = llama.num_layers
    assert more.attention_s - base.attention_s == pytest.approx(layers * 3 * 1e-6)
    assert more.launch_s - base.launch_s == pytest.approx(layers * 1e-5)
    assert more.total_s - base.total_s == pytest.approx(layers * (3e-6 + 1e-5))


def _overlapped_trace(device_s, take_s, host_s):
    """start_s and blocked_ms of an overlapped run: tick j dispatches step j after ``host_s``,
    waits for step j − 1 and takes its tokens in ``take_s[j − 1]``; the device runs the steps
    back to back once dispatched."""
    start, blocked, done = [0.0], [], []
    for j, d in enumerate(device_s):
        dispatched = start[j] + host_s
        done.append(max(dispatched, done[-1] if done else 0.0) + d)
        if j == 0:
            blocked.append(0.0)
            start.append(dispatched)
            continue
        blocked.append(1e3 * max(0.0, done[j - 1] - dispatched))
        start.append(max(dispatched, done[j - 1]) + take_s[j - 1])
    return np.array(start[:-1]), np.array(blocked)


def test_overlapped_step_times_read_the_device_time_where_the_trace_tells_it():
    kinds = ["prefill", "prefill", "decode", "decode", "decode", "decode", "decode", "decode"]
    device = [0.050, 0.048, 0.016, 0.015, 0.017, 0.0005, 0.016, 0.016]
    take = [0.001 if k == "prefill" else 0.004 for k in kinds]
    start, blocked = _overlapped_trace(device, take, host_s=0.002)
    got = overlapped_step_times(start, blocked, kinds)
    # steps 1, 3 and 4 read exactly; step 2 follows a step of another kind (other takings);
    # step 5 is shorter than the host's work, so the tick that waited for it did not wait (and
    # step 6 started when dispatched, after an idle device); the last two have no tick after
    np.testing.assert_allclose(got[[1, 3, 4]], [0.048, 0.015, 0.017])
    assert np.isnan(got[[0, 2, 5, 6, 7]]).all()
    assert blocked[6] == 0.0 and (blocked[1:6] > 1).all()


def test_fit_recovers_known_numbers_and_regimes_apart(llama):
    rng = np.random.default_rng(0)
    loads = [step_load(256, np.ones(n), rng.integers(100, 2000, n), 256)
             for n in rng.integers(64, 256, 12)]
    loads += [step_load(t, np.array([t // 2, t // 2]), np.array([t // 2, t // 2]), 256)
              for t in (2048, 4096)]
    groups = [str(i) for i in range(len(loads))]
    truth = {"run": dataclasses.replace(H200, matmul_eff=0.8, memory_eff=0.5,
                                        attention_seq_s=3e-7, layer_s=2e-5),
             "replay": dataclasses.replace(H200, matmul_eff=0.8, memory_eff=1.1,
                                           attention_seq_s=3e-7, layer_s=2e-5)}
    sets = [StepSet(llama, "bfloat16", TimedSteps(
        loads, predicted_times(truth[r], llama, "bfloat16", loads), groups), r)
        for r in ("run", "replay")]
    names = ("matmul_eff", "memory_eff", "attention_seq_s", "layer_s")
    fitted = fit_profile(H200, sets, names, per_regime=("memory_eff",))
    for regime, profile in fitted.items():
        for name in names:
            assert getattr(profile, name) == pytest.approx(getattr(truth[regime], name), rel=2e-3)
    errors = group_errors(fitted["run"], llama, "bfloat16", sets[0].steps)
    assert len(errors) == len(loads) and all(abs(e.error) < 1e-3 for e in errors)
    with pytest.raises(ValueError, match="cannot fit"):
        fit_profile(H200, sets, ("num_layers",))
    empty = StepSet(llama, "bfloat16", TimedSteps(loads[:1], np.array([np.nan]), ["0"]))
    with pytest.raises(ValueError, match="no measured step"):
        fit_profile(H200, [empty], names)


def test_prefixes_kept_as_parents_and_prompts_made_from_them(tmp_path, llama):
    prompts = [[1, 2, 3], [1, 2, 4, 5], [6], [1, 2, 3, 7], [6]]
    assert prefix_parents(prompts) == [(-1, 0), (0, 2), (-1, 0), (0, 3), (2, 1)]
    path = tmp_path / "run.jsonl.gz"
    records = [dict(kind="prefill", prefill_reqs=5, decode_reqs=0, prefill_tokens=15,
                    bucket_tokens=16, bucket_seqs=8, bucket_kv_tokens=16, kv_tokens_used=15,
                    cached_tokens=0, start_s=0.5, host_ms=1.25, blocked_ms=0.0)]
    loads = [step_load(16, np.array([3, 4, 1, 4, 1]), np.array([3, 4, 1, 4, 1]), 8)]
    write_recorded_run(path, "llama-3-8b", {"context_length": 64}, {"duration_s": 1.5},
                       prompts, [2, 2, 2, 2, 2], records, loads)
    run = read_recorded_run(path)
    assert run.engine == {"context_length": 64} and run.figures == {"duration_s": 1.5}
    assert run.requests.tolist() == [[3, 2, -1, 0], [4, 2, 0, 2], [1, 2, -1, 0], [4, 2, 0, 3],
                                     [1, 2, 2, 1]]
    steps = timed_steps(run)
    assert steps.loads == loads and steps.groups == ["prefill 16 tokens"]
    made = synthetic_prompts(run.requests, 10**6)
    assert [len(p) for p in made] == [3, 4, 1, 4, 1]
    assert made[1][:2] == made[0][:2] and made[3][:3] == made[0][:3] and made[4] == made[2]
    assert prefix_parents(made) == prefix_parents(prompts)
    with pytest.raises(ValueError, match="records: 1 steps, loads: 2"):
        write_recorded_run(path, "llama-3-8b", {}, {}, prompts, [2] * 5, records, loads * 2)


def test_the_h200_profile_gives_back_the_real_run_it_was_fitted_to(llama):
    """Every group of the trace's readable steps within 10 % (median against median), and the
    recorded workload replayed on the simulated H200: the real run's schedule, step for step,
    and its duration within 5 %. The replay counts the host's modeled time only (the profile's
    dispatch cost), not this machine's: the same figures however loaded it is."""
    run = read_recorded_run(DATA)
    steps = timed_steps(run)
    errors = group_errors(H200, llama, "bfloat16", steps)
    decodes = {step_group("decode", n, n) for n in (64, 96, 128, 192, 256)}
    prefills = {step_group("prefill", t, 256) for t in (2048, 4096)}
    assert {e.group for e in errors} == decodes | prefills
    assert sum(e.steps for e in errors) == 2591  # of 3,797: those the trace tells (calibration.py)
    assert all(abs(e.error) <= 0.10 for e in errors), errors
    result = replay(run, simulated_host_time="modeled")
    for column in SCHEDULE:
        assert np.array_equal(result.steps[column], run.steps[column]), column
    assert result.duration_s == pytest.approx(run.figures["duration_s"], rel=0.05)
    assert result.total_throughput == pytest.approx(run.figures["total_throughput"], rel=0.05)


def test_a_modeled_host_gives_the_same_run_every_time(llama):
    """With simulated_host_time="modeled" the host's own work takes no virtual time: two runs
    of one workload stamp identical times; measured, the real scheduler's time counts."""
    from minijax_serve import Engine, SamplingParams

    def run(host_time):
        engine = Engine("llama-3-8b", simulate="h200", skip_tokenizer_init=True,
                        simulated_host_time=host_time, context_length=256,
                        max_running_requests=8, max_total_tokens=4096)
        outs = engine.generate([[5] * (20 + 7 * i) for i in range(12)],
                               SamplingParams(max_new_tokens=9, ignore_eos=True))
        engine.check_invariants()
        return [(o.arrival_time, *o.token_times, o.finish_time) for o in outs], engine.clock

    first, clock = run("modeled")
    second, _ = run("modeled")
    assert first == second and not clock.follow_wall
    measured, clock = run("measured")
    assert clock.follow_wall and len(measured) == len(first)
    with pytest.raises(ValueError, match="simulated_host_time must be measured or modeled"):
        Engine("llama-3-8b", simulate="h200", simulated_host_time="wall")
