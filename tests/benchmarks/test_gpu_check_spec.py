"""gpu_check.sh's opt-in ``spec`` section in its tiny mode on CPU: n-gram speculation against
none on ShareGPT copies (at concurrency 8: the GPU's 1 and 8 run the same loop), every request
completed, the table's rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gpu_check_spec_tiny_on_cpu(tmp_path):
    out = tmp_path / "gpu_out"
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, JAX_PLATFORMS="cpu",
               GPU_CHECK_SECTIONS="spec")
    res = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), "--tiny"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=480)
    assert res.returncode == 0, res.stdout + res.stderr
    table = res.stdout[res.stdout.index("gpu_check summary"):]
    assert "spec: ok" in table and "spec tiny_model_wide at 8, ngram" in table
    runs = [json.loads(line) for line in (out / "spec.jsonl").read_text().splitlines()]
    assert [(r["max_concurrency"], r["compare"]["value"]) for r in runs] == [
        (8, None), (8, "ngram")]
    assert all(r["completed"] == r["num_requests"] == 4 for r in runs)
    assert all(r["spec_proposed_tokens"] == 0 for r in runs[::2])
