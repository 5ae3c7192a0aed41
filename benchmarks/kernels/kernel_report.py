"""The rows of ``bench_kernels.py``: each case run with its error caught, printed as it
finishes, and saved in the run's JSON object after every row (a run cut short keeps them)."""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path
from typing import Any, Callable

T0 = time.perf_counter()  # the rows' done_at_s count from here (import time)
HEADERS = {"lowered": "lowered for CUDA (interpret=False)",
           "correctness": "||out - ref|| / ||ref||, ref = the jnp reference in float32",
           "timings": "bf16, median per call | useful bytes/s | % of the copy bandwidth "
                      "(both read + write) | attention FLOP/s | % of the bf16 matmul peak",
           "sweep": "tile sizes and Triton settings of the Pallas kernels, bf16, same columns "
                    "(information only)",
           "grid": "decode batch x context, bf16, same columns (information only)"}
BANDWIDTH_CONVENTION = ("bytes/s = (bytes read + bytes written) / s for the kernels (K/V and q "
                        "read, output written) and for the copy (ceilings.copy_bandwidth)")


class Report:
    """The run's JSON object, rewritten after every case as the last line of ``path``."""

    def __init__(self, path: str | None, obj: dict[str, Any]):
        self.path, self.obj = (Path(path) if path else None), obj
        self.before = self.path.read_text() if self.path and self.path.is_file() else ""
        if self.before and not self.before.endswith("\n"):
            self.before += "\n"

    def save(self) -> None:  # write then rename: a run killed mid-write leaves the last save
        if self.path:
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(self.before + json.dumps(self.obj, default=str) + "\n")
            os.replace(tmp, self.path)


def run_case(report: Report, key: str, row: dict[str, Any], body: Callable[[], dict]) -> dict:
    """Run one case, catching its error, print it, add it to the report and save."""
    try:
        row.update(body())
    except Exception as e:  # noqa: BLE001 - one failing case must not stop the others
        row["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    row["done_at_s"] = round(time.perf_counter() - T0, 2)
    report.obj[key].append(row)
    report.save()
    print(format_row(key, row), flush=True)
    return row


def format_row(key: str, r: dict[str, Any]) -> str:
    head = f"{r['case']:<16} {r['impl']:<14}"
    if "error" in r:
        return f"{head} ERROR{'' if r.get('required', True) else ' (info only)'} {r['error'][:200]}"
    if key == "correctness":
        verdict = "ok" if r["ok"] else ("FAIL" if r["required"] else "above (info only)")
        return (f"{head} {r['dtype']:<9} rel err {r['rel_err']:.2e} "
                f"(<= {r['threshold']:.0e}) {verdict}")
    if key == "lowered":
        return (f"{head} {r['dtype']:<9} lowered for cuda: {r['kernel_calls']} kernel call(s), "
                f"{r['chars']} chars of StableHLO")
    return (f"{head} {r['median_s'] * 1e3:9.3f} ms {r['bytes_per_s'] / 1e9:9.1f} GB/s "
            f"{r['fraction_of_copy'] * 100:6.1f} % {r['flops_per_s'] / 1e12:8.3f} TFLOP/s "
            f"{r['fraction_of_matmul'] * 100:5.1f} %  "
            f"compile {r['compile_s']:5.1f} s, {r['samples']}x{r['inner']} calls")


def print_summary(obj: dict[str, Any], seed: int, sections: dict[str, list[str]]) -> None:
    """The run's rows again as one table, then ``sections`` (a header and its lines, left out
    when it has none)."""
    print("=" * 100)
    if "copy_bytes_per_s" in obj:
        print(f"copy bandwidth {obj['copy_bytes_per_s'] / 1e9:.1f} GB/s "
              f"(read + written, {obj['copy_mib']} MiB); bf16 matmul peak "
              f"{obj['matmul_bf16_flops_per_s'] / 1e12:.3g} TFLOP/s; seed {seed}")
    for k in HEADERS:
        if obj.get(k):
            print(f"-- {HEADERS[k]}")
        for r in obj.get(k, []):
            print(format_row(k, r))
    for header, lines in sections.items():
        if lines:
            print(f"-- {header}")
            print("\n".join(lines))
    print("=" * 100)
