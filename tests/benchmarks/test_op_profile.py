"""benchmarks/op_profile.py: self time per op from a trace's events (synthetic traces: a
host's XLA ops, a device's stream kernels)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import op_profile  # noqa: E402


def test_op_profile_sums_self_time_per_op(capsys):
    span = lambda name, ts, dur, tid=1, pid=1: {"ph": "X", "name": name, "ts": ts,  # noqa: E731
                                                "dur": dur, "pid": pid, "tid": tid}
    steps = op_profile.PROFILED_STEPS
    host = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}}]
    for i in range(steps):  # per step: a loop of 90 us holding two dots of 20 us, a gather
        t = i * 1000
        host += [span("while.3", t, 90), span("ynn_fusion.7", t + 10, 20),
                 span("ynn_fusion.7", t + 40, 20), span("copy_fusion", t + 95, 5, tid=2),
                 span("ThunkExecutor::Execute", t, 100), span("$python.py:1 f", t, 100)]
    op_profile.print_op_times(host)
    out = capsys.readouterr().out
    top = out[:out.index("by kind")]
    assert "0.05       1x  while.3" in top  # 90 us less the 40 us of its body
    assert "0.04       2x  ynn_fusion.7" in top and "0.01       1x  copy_fusion" in top
    assert "ThunkExecutor" not in out and "$python" not in out
    assert "0.04     1 ops x     2  ynn_fusion" in out[out.index("by kind"):]
    # with a device in the trace, its kernels (whatever their names) and not the host's ops
    device = [{"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "pid": 7, "tid": 13, "name": "thread_name", "args": {"name": "Stream #13"}},
              {"ph": "M", "pid": 7, "tid": 2, "name": "thread_name", "args": {"name": "XLA Ops"}}]
    for i in range(steps):  # a stream's kernels, and a derived line repeating their time
        t = i * 1000
        device += [span("ragged_paged_attention", t, 30, pid=7, tid=13),
                   span("void cutlass::Kernel<sm90_gemm>(Params)", t + 30, 60, pid=7, tid=13),
                   span("custom-call.3", t, 30, pid=7, tid=2)]
    op_profile.print_op_times(host + device)
    out = capsys.readouterr().out
    assert "all ops: 0.09 ms per step" in out
    assert "0.06       1x  void cutlass::Kernel<sm90_gemm>(Params)" in out
    assert "0.03       1x  ragged_paged_attention" in out and "while.3" not in out
    assert "custom-call" not in out
    # a device with no kernel in the trace: the host's ops after all
    op_profile.print_op_times(host + device[:1])
    assert "0.05       1x  while.3" in capsys.readouterr().out
    op_profile.print_op_times([e for e in host if e["name"][0].isupper() or e["ph"] == "M"])
    assert "no op events" in capsys.readouterr().out
