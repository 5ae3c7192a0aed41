"""A recorded run's workload replayed on a simulated device
(:mod:`minijax_serve.simulate.recorded_run` stores it): the engine on the run's flags, every request
at once, EOS ignored, as the benchmark ran it."""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import numpy as np

from minijax_serve.core.sampling_params import SamplingParams
from minijax_serve.engine import Engine
from minijax_serve.engine.trace import to_columns
from minijax_serve.simulate.recorded_run import RecordedRun, synthetic_prompts


class Replay(NamedTuple):
    """A recorded run's workload run again on a simulated device."""

    duration_s: float  # first arrival to last finish, on the engine's clock
    total_throughput: float  # prompt and output tokens per second
    steps: dict[str, np.ndarray]  # the replay's step records, as columns
    wall_s: float  # how long the replay took on this machine


def replay(run: RecordedRun, simulate: str = "h200", seed: int = 0, **overrides: Any) -> Replay:
    """Run the recorded workload (:func:`synthetic_prompts`, every request at once, ignoring
    EOS as the benchmark does) on an engine with the run's flags, simulating ``simulate``;
    ``overrides``: engine flags to change."""
    start = time.perf_counter()
    engine = Engine(run.model, simulate=simulate, skip_tokenizer_init=True, record_steps=True,
                    **{**run.engine, **overrides})
    prompts = synthetic_prompts(run.requests, engine.model_config.vocab_size, seed)
    params = [SamplingParams(max_new_tokens=int(n), ignore_eos=True) for n in run.requests[:, 1]]
    outs = engine.generate(prompts, params)
    engine.check_invariants()
    duration = max(o.finish_time for o in outs) - min(o.arrival_time for o in outs)
    tokens = int(run.requests[:, 0].sum() + sum(len(o.token_ids) for o in outs))
    return Replay(duration, tokens / duration, to_columns(engine.step_records()),
                  time.perf_counter() - start)
