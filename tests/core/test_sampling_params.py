"""SamplingParams and EngineConfig check themselves when made: every bad field is a ValueError
naming it and its limit; numpy numbers are taken as Python ones. (The checks against an
engine's limits, before anything is queued, are in test_engine.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from minijax_serve import EngineConfig, SamplingParams

BAD_PARAMS = [  # SamplingParams fields -> message: raised when the params are made
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"), (dict(top_p=1.5), "top_p"),
    (dict(min_p=1.0), "min_p"), (dict(min_p=-0.1), "min_p"),
    (dict(top_k=0), "top_k"), (dict(top_k=-2), "top_k"), (dict(top_k=2.5), "top_k"),
    (dict(top_k=2**31), r"top_k must be -1 \(off\) or an integer in \[1, 2147483647\], got "
                        r"2147483648"), (dict(top_k=True), "top_k"),
    (dict(max_new_tokens=0), r"max_new_tokens must be an integer >= 1, got 0"),
    (dict(max_new_tokens=True), "max_new_tokens"),
    (dict(min_new_tokens=5, max_new_tokens=4), r"min_new_tokens must be an integer in \[0, 4\]"),
    (dict(logprobs=-1), r"logprobs must be an integer in \[0, 20\], got -1"),
    (dict(logprobs=21), "logprobs"), (dict(logprobs=2.0), "logprobs"),
    (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(repetition_penalty=0.0), r"repetition_penalty must be finite and > 0"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(repetition_penalty=1e-300), r"repetition_penalty .* in \[1.175e-38, 3.403e\+38\] "
                                      r"\(float32\), got 1e-300"),
    (dict(repetition_penalty=1e39), "repetition_penalty"),
    (dict(frequency_penalty=2.5), r"frequency_penalty must be in \[-2, 2\]"),
    (dict(presence_penalty=-2.1), "presence_penalty"),
    (dict(n=0), r"n must be an integer >= 1, got 0"),
    (dict(seed=2**32), "seed"), (dict(stop=[""]), "stop"), (dict(stop=3), "stop"),
    (dict(stop_token_ids=[1, "a"]), "stop_token_ids"),
    (dict(stop_token_ids=[True]), "stop_token_ids"), (dict(ignore_eos=1), "ignore_eos"),
]


@pytest.mark.parametrize("fields,message", BAD_PARAMS)
def test_bad_sampling_params_raise_when_made(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


def test_numpy_integers_are_taken_as_ints():
    params = SamplingParams(max_new_tokens=np.int64(8), top_k=np.int32(5), seed=np.uint32(7),
                            stop_token_ids=[np.int64(3)], logit_bias={np.int64(2): 1.0},
                            logprobs=np.int8(2))
    assert params == SamplingParams(max_new_tokens=8, top_k=5, seed=7, stop_token_ids=[3],
                                    logit_bias={2: 1.0}, logprobs=2)
    assert all(type(v) is int for v in (params.max_new_tokens, params.top_k, params.seed,
                                        *params.stop_token_ids, params.logit_bias[0][0]))
    config = EngineConfig(page_size=np.int64(32), seed=np.uint32(3), context_length=np.int16(64))
    assert type(config.page_size) is type(config.seed) is type(config.context_length) is int
    hot = SamplingParams(temperature=np.float32(0.5), top_p=np.float16(0.5))  # numpy floats too
    assert (hot.temperature, hot.top_p) == (0.5, 0.5) and type(hot.temperature) is float
