"""The bench driver's arrival and concurrency rules, on a fake engine and clock."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from minijax_serve.bench.driver import arrival_offsets, drive
from tests.bench.test_bench import _out


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


class FakeEngine:
    """Every step takes ``step_s`` and gives each unfinished request one token."""

    def __init__(self, clock, step_s=0.1):
        self.clock, self.step_s, self.reqs, self.steps = clock, step_s, {}, 0

    def add_request(self, prompt, params):
        rid = str(len(self.reqs))
        self.reqs[rid] = SimpleNamespace(prompt=prompt, n=params.max_new_tokens, times=[])
        return rid

    def has_unfinished(self):
        return any(len(r.times) < r.n for r in self.reqs.values())

    def stats(self):
        return {"decode_steps": self.steps}

    def step(self):
        self.clock.now += self.step_s
        self.steps += 1
        outs = []
        for rid, r in self.reqs.items():
            if len(r.times) < r.n:
                r.times.append(self.clock.now)
                out = _out(len(r.prompt), r.times, rid=rid)
                out.finished = len(r.times) == r.n
                outs.append(out)
        return outs


def _drive(offsets, concurrency=None, out_len=2):
    clock = FakeClock()
    engine = FakeEngine(clock)
    done = []
    params = [SimpleNamespace(max_new_tokens=out_len)] * len(offsets)
    run = drive(engine, [[1, 2]] * len(offsets), params, offsets, concurrency,
                on_finish=done.append, clock=clock, sleep=clock.sleep)
    return run, done


def test_drive_counts_latency_from_the_scheduled_arrival():
    run, done = _drive([0.0, 0.05, 0.5])
    assert run.sent == pytest.approx([0.0, 0.05, 0.5])  # request 1 queued at 0.1, sent at 0.05
    ttft = [o.first_token_time - s for o, s in zip(run.outputs, run.sent)]
    assert ttft == pytest.approx([0.1, 0.15, 0.1])
    assert all(o.first_token_time > s for o, s in zip(run.outputs, run.sent))
    assert run.duration == pytest.approx(0.7)  # idle 0.3 -> 0.5, then two steps
    assert sum(done) == 3 and run.errors == [None] * 3


def test_drive_max_concurrency_holds_requests_back():
    run, _ = _drive([0.0, 0.05, 0.5], concurrency=1)
    # request 1 waits for request 0 to finish (0.2); request 2 arrives after request 1 ends
    assert run.sent == pytest.approx([0.0, 0.2, 0.5])
    run, _ = _drive([0.0] * 4, concurrency=2)
    assert run.sent == pytest.approx([0.0, 0.0, 0.2, 0.2])
    assert run.duration == pytest.approx(0.4)


def test_arrival_offsets():
    assert arrival_offsets(4, float("inf")).tolist() == [0.0] * 4
    off = arrival_offsets(4000, 10.0, seed=3)
    assert off[0] == 0.0 and np.all(np.diff(off) >= 0)
    assert np.diff(off).mean() == pytest.approx(0.1, rel=0.1)  # Poisson: mean gap 1 / rate
    assert np.array_equal(off, arrival_offsets(4000, 10.0, seed=3))
    dataset_draws = np.random.default_rng(3).gamma(1.0, 0.1, size=3999)  # --seed 3's dataset rng
    assert not np.allclose(np.diff(off), dataset_draws)  # the gaps have a generator of their own
    bursty = np.diff(arrival_offsets(4000, 10.0, burstiness=0.25, seed=3))
    assert bursty.mean() == pytest.approx(0.1, rel=0.15) and bursty.std() > 1.5 * np.diff(off).std()
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0)
