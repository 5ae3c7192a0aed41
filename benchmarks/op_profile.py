"""Where a step's time goes, from a ``jax.profiler`` trace: self time per op, per step.

:func:`trace_events` runs a function a few times under the profiler and returns the trace's
events; :func:`print_op_times` sums them. On an accelerator the trace has a process per device
(``/device:GPU:0``: one thread per stream) whose events are its kernels (XLA's fusions, cuBLAS
GEMMs, the Pallas kernels by name, copies); those are counted, and the host's are not (the
host's, when the device shows no kernel: a trace without the GPU's activity). On CPU
there is only ``/host:CPU``, whose XLA ops (lower-case names, not the runtime's or Python's own
spans) are counted; where the CPU runtime leaves them out of a trace,
``XLA_FLAGS=--xla_cpu_enable_xprof_traceme=true`` brings them in. Ops nest
(a loop's time excludes its body's ops): self time is an event's duration less that of the
events nested in it on its thread.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import re
import tempfile
from typing import Any, Callable

import jax

PROFILED_STEPS = 3
XLA_OP = re.compile(r"[a-z_][\w.-]*")


def trace_events(run: Callable[[], Any], steps: int = PROFILED_STEPS) -> list[dict]:
    """The trace events of ``steps`` calls of ``run`` (each blocked on its result)."""
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
        try:
            for _ in range(steps):
                jax.block_until_ready(run())
        finally:
            jax.profiler.stop_trace()
        trace = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[0]
        with gzip.open(trace) as f:
            return json.load(f)["traceEvents"]


def _names(events: list[dict], kind: str) -> dict:
    key = (lambda e: e["pid"]) if kind == "process_name" else (lambda e: (e["pid"], e.get("tid")))
    return {key(e): e.get("args", {}).get("name", "") for e in events
            if e.get("ph") == "M" and e.get("name") == kind}


def op_events(events: list[dict]) -> list[dict]:
    """The events that are ops: the kernels of the device processes if the trace has any (on
    their ``Stream`` threads where threads are named so: a device's other lines, modules and
    name scopes, repeat the same time), else the host's XLA ops."""
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    devices = {pid for pid, name in _names(events, "process_name").items()
               if name.startswith("/device:")}
    streams = {key for key, name in _names(events, "thread_name").items()
               if key[0] in devices and name.startswith("Stream")}
    kernels = [e for e in complete if e["pid"] in devices
               and (not streams or (e["pid"], e.get("tid")) in streams)]
    return kernels or [e for e in complete if XLA_OP.fullmatch(e["name"])]


def self_times(events: list[dict]) -> tuple[collections.Counter, collections.Counter]:
    """(self time in µs, calls) per op name over ``events`` (ops, see :func:`op_events`)."""
    by_thread = collections.defaultdict(list)
    for e in events:
        by_thread[e["pid"], e.get("tid")].append(e)
    self_us, calls = collections.Counter(), collections.Counter()
    for spans in by_thread.values():
        spans.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_spans: list[dict] = []
        for e in spans:
            while open_spans and open_spans[-1]["ts"] + open_spans[-1]["dur"] <= e["ts"]:
                open_spans.pop()
            if open_spans:
                self_us[open_spans[-1]["name"]] -= e["dur"]
            self_us[e["name"]] += e["dur"]
            calls[e["name"]] += 1
            open_spans.append(e)
    return self_us, calls


def print_op_times(events: list[dict], steps: int = PROFILED_STEPS, top: int = 15) -> None:
    """The ``top`` ops by self time (ms and calls per step), then the totals per kind (the name
    without its ``.N`` suffix) and number of calls per step."""
    ops = op_events(events)
    if not ops:
        print("  no op events in the trace (on CPU: XLA_FLAGS=--xla_cpu_enable_xprof_traceme=true)")
        return
    self_us, calls = self_times(ops)
    per_step = lambda us: us / steps / 1e3  # noqa: E731
    print(f"  all ops: {per_step(sum(self_us.values())):.2f} ms per step")
    print(f"  top {top} ops by self time (ms per step, calls per step):")
    for name, us in self_us.most_common(top):
        print(f"    {per_step(us):9.2f}  {calls[name] // steps:6d}x  {name[:90]}")
    kinds, kind_calls = collections.Counter(), collections.Counter()
    for name, us in self_us.items():
        kind = (re.sub(r"(\.\d+|\.clone)+$", "", name), calls[name] // steps)
        kinds[kind] += us
        kind_calls[kind] += 1
    print("  by kind of op (ms per step; ops of that kind x calls per step of each):")
    for (kind, n), us in kinds.most_common(top):
        print(f"    {per_step(us):9.2f}  {kind_calls[kind, n]:4d} ops x {n:5d}  {kind[:80]}")
