"""Fitting a device profile to measured steps, and reading a step's device time from a trace.

A calibration fits a few of a :class:`DeviceProfile`'s numbers (efficiencies of its roofline
terms, fixed costs) so that the :class:`CostModel` gives back measured step times: least squares
on the log of predicted / measured time, every group of steps (a kind of step in one bucket)
weighing the same whatever its number of steps, so that a few long prefill steps count as much
as a thousand decode steps. The ceilings stay as measured, and any number not fitted keeps its
value: a fit changes only what the measurements can tell.

:func:`overlapped_step_times` reads each step's device time from the step trace of a run with
overlap scheduling (``record_steps``; trace.py), where the device's time is not recorded as such.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Sequence

import numpy as np

from minijax_serve.models.config import ModelConfig
from minijax_serve.simulate.cost_model import CostModel, StepLoad
from minijax_serve.simulate.profiles import DeviceProfile

# what each fittable number may take: a matmul reaches at most 4x the square matmul's ceiling; a
# read-only stream at most 2x the copy's (which counts bytes read and written); fixed costs are
# at most a millisecond per sequence and layer, 10 ms per layer, a second per step
BOUNDS = {"matmul_eff": (1e-3, 4.0), "memory_eff": (1e-3, 2.0),
          "attention_flops_eff": (1e-3, 4.0), "attention_bw_eff": (1e-3, 2.0),
          "attention_seq_s": (0.0, 1e-3), "layer_s": (0.0, 1e-2), "launch_s": (0.0, 1.0)}
BLOCKED_MS = 0.5  # a tick that waited at least this long on the device: the device was busy


class TimedSteps(NamedTuple):
    """Measured steps: each one's load, its device time (NaN: not measured) and its group."""

    loads: Sequence[StepLoad]
    measured_s: np.ndarray
    groups: Sequence[str]


class GroupError(NamedTuple):
    """One group's median measured and predicted step time, over its measured steps."""

    group: str
    steps: int
    measured_s: float
    predicted_s: float

    @property
    def error(self) -> float:
        """predicted / measured − 1."""
        return self.predicted_s / self.measured_s - 1.0


def step_group(kind: str, bucket_tokens: int, bucket_seqs: int) -> str:
    """A step's group: its kind and the bucket that sets its cost (a decode step's sequences,
    another step's tokens)."""
    return f"{kind} {bucket_seqs} seqs" if kind == "decode" else f"{kind} {bucket_tokens} tokens"


def overlapped_step_times(start_s: np.ndarray, blocked_ms: np.ndarray,
                          kinds: Sequence[str]) -> np.ndarray:
    """Each step's device time in a run with overlap scheduling, from its trace (NaN where it
    cannot be read).

    Tick ``j`` dispatches step ``j``, then waits for step ``j − 1`` and takes its tokens. When
    ticks ``j`` and ``j + 1`` both waited on the device (``blocked_ms`` ≥ :data:`BLOCKED_MS`),
    step ``j`` was queued before step ``j − 1`` ended, so it ran from the end of ``j − 1`` to
    its own end, and tick ``j + 1`` lasted from the end of step ``j − 1`` (plus the time to take
    its tokens) to the end of step ``j`` (plus the time to take those): its duration is step
    ``j``'s device time plus the difference of the two takings. That difference is small when
    the two steps are of the same kind (a decode step's hundreds of tokens take longer than a
    prefill step's few), so only such steps are read: a step after one of another kind is NaN.
    """
    start = np.asarray(start_s, np.float64)
    waited = np.asarray(blocked_ms) >= BLOCKED_MS
    out = np.full(len(start), np.nan)
    for j in range(1, len(start) - 2):
        if waited[j] and waited[j + 1] and kinds[j] == kinds[j - 1]:
            out[j] = start[j + 2] - start[j + 1]
    return out


def predicted_times(profile: DeviceProfile, cfg: ModelConfig, dtype,
                    loads: Sequence[StepLoad]) -> np.ndarray:
    """The cost model's time of each step (greedy, no logprobs: a benchmark's steps)."""
    cost = CostModel(profile, cfg, dtype)
    return np.array([cost.cost(load, greedy=True).total_s for load in loads])


def group_errors(profile: DeviceProfile, cfg: ModelConfig, dtype,
                 steps: TimedSteps) -> list[GroupError]:
    """Per group (sorted), the median measured time of its measured steps against the median
    of the cost model's times for the same steps."""
    ok = np.isfinite(steps.measured_s)
    loads = [load for load, keep in zip(steps.loads, ok) if keep]
    predicted = predicted_times(profile, cfg, dtype, loads)
    groups = np.array(steps.groups)[ok]
    measured = steps.measured_s[ok]
    return [GroupError(g, int((groups == g).sum()), float(np.median(measured[groups == g])),
                       float(np.median(predicted[groups == g])))
            for g in sorted(set(groups.tolist()))]


class StepSet(NamedTuple):
    """Measured steps of one model, in one regime: ``"run"`` (steps timed in a run) or another
    (e.g. ``"replay"``: one step dispatched back to back, as step_roofline.py times them)."""

    cfg: ModelConfig
    dtype: Any
    steps: TimedSteps
    regime: str = "run"


def fit_profile(base: DeviceProfile, sets: Sequence[StepSet], names: Sequence[str],
                per_regime: Sequence[str] = ()) -> dict[str, DeviceProfile]:
    """``base`` with the numbers ``names`` fitted to the measured steps of every set (least
    squares on the log of predicted / measured time, each group of a set weighing the same;
    bounds :data:`BOUNDS`), those of ``per_regime`` (some of ``names``) fitted apart for each
    regime; returns each regime's profile."""
    from scipy.optimize import least_squares

    unknown = set(names) - set(BOUNDS)
    if unknown or not set(per_regime) <= set(names):
        raise ValueError(f"names: cannot fit {sorted(unknown)}, or per_regime {list(per_regime)} "
                         f"is not among them; fittable: {sorted(BOUNDS)}")
    regimes = sorted({s.regime for s in sets})
    shared = [n for n in names if n not in per_regime]
    keys = shared + [(n, r) for r in regimes for n in per_regime]
    prepared = []
    for s in sets:
        ok = np.isfinite(s.steps.measured_s)
        groups = np.array(s.steps.groups)[ok]
        if not len(groups):
            raise ValueError(f"sets: no measured step among the {s.regime} steps of a set")
        _, index, counts = np.unique(groups, return_inverse=True, return_counts=True)
        loads = [load for load, keep in zip(s.steps.loads, ok) if keep]
        prepared.append((s, loads, s.steps.measured_s[ok], 1.0 / np.sqrt(counts[index])))
    bound = [BOUNDS[k if isinstance(k, str) else k[0]] for k in keys]
    lo, hi = np.array([b[0] for b in bound]), np.array([b[1] for b in bound])

    def profiles(x) -> dict[str, DeviceProfile]:
        values = dict(zip(keys, map(float, x)))
        return {r: dataclasses.replace(base, **{n: values[n] for n in shared},
                                       **{n: values[(n, r)] for n in per_regime})
                for r in regimes}

    def residuals(x: np.ndarray) -> np.ndarray:
        by_regime = profiles(x)
        return np.concatenate([
            weight * np.log(predicted_times(by_regime[s.regime], s.cfg, s.dtype, loads) / measured)
            for s, loads, measured, weight in prepared])

    start = np.clip([getattr(base, k if isinstance(k, str) else k[0]) for k in keys], lo, hi)
    fit = least_squares(residuals, x0=start, bounds=(lo, hi), x_scale="jac")
    rounded = [float(f"{v:.4g}") for v in fit.x]
    return profiles(np.array(rounded))
