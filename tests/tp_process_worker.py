"""One of two processes sharing a tensor-parallel mesh over 127.0.0.1 (run by
test_tensor_parallel.py): two forced CPU devices each, gloo collectives, tp = 4 over both.

    python tests/tp_process_worker.py COORDINATOR PROCESS_ID MODEL_DIR CASE.json

CASE.json: {"prompts": [[ids]], "new": N, "disagree": bool}. With ``disagree``, process 1
submits other prompts: both must raise the agreement error (printed as ``AGREEMENT_ERROR``).
Writes the greedy token ids as JSON otherwise, either to ``CASE.json.<PROCESS_ID>`` (not to
stdout, where gloo's threads write too, at any time, even inside a line of ours).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} "
                           "--xla_force_host_platform_device_count=2").strip()  # the last wins

# the repository first, not tests/ (run as a script, its folders would shadow modules of the
# same name that libraries import, e.g. transformers' `kernels`)
sys.path[0] = str(Path(__file__).resolve().parents[1])

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")


def main() -> None:
    coordinator, process_id, model_dir, case_path = sys.argv[1:5]
    jax.distributed.initialize(coordinator, num_processes=2, process_id=int(process_id))
    from minijax_serve import Engine, SamplingParams

    case = json.loads(open(case_path).read())

    def result(text: str) -> None:
        with open(f"{case_path}.{process_id}", "w") as f:
            f.write(text)

    # the pool sized by default, as a user's: each process reads its own device's memory and
    # the processes agree on the smallest (a remote device's memory raised on process 1, and
    # process 0 then waited in gloo's initialisation until DEADLINE_EXCEEDED)
    engine = Engine(model_dir, tensor_parallel_size=4, skip_tokenizer_init=True, page_size=16,
                    max_running_requests=3, chunked_prefill_size=32,
                    enable_mixed_chunk=True, min_token_bucket=16, min_seq_bucket=4,
                    min_kv_bucket=128)
    prompts = case["prompts"]
    if case["disagree"] and jax.process_index() == 1:
        prompts = prompts[::-1]
    try:
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=case["new"], ignore_eos=True))
    except ValueError as err:
        if "processes disagree on the submitted requests" in str(err):
            result("AGREEMENT_ERROR")
            return
        raise
    engine.check_invariants()
    assert engine.stats()["num_processes"] == 2 and engine.stats()["num_devices"] == 4
    result(json.dumps([o.token_ids for o in outs]))


if __name__ == "__main__":
    main()
