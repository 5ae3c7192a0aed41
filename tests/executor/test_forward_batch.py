"""The batch a step receives: packed into one vector on the host, unpacked inside the step."""

import jax
import numpy as np

from minijax_serve.executor.buckets import StepShape
from minijax_serve.executor.forward_batch import (PACKED_FIELDS, SAMPLING_FIELDS, ForwardBatch,
                                                  empty_forward_batch, pack, sampling_size, unpack,
                                                  unpack_sampling)


def random_batch(shape: StepShape, rng: np.random.Generator) -> ForwardBatch:
    """Random bits in every array; the host flags (not sent) random too."""
    fields = []
    for x in empty_forward_batch(shape)[:len(PACKED_FIELDS)]:
        if x.dtype == np.float32:
            fields.append(rng.standard_normal(x.shape).astype(np.float32))
        else:
            info = np.iinfo(x.dtype)
            fields.append(rng.integers(info.min, info.max, x.shape, dtype=x.dtype, endpoint=True))
    return ForwardBatch(*fields, *(bool(b) for b in rng.random(3) < 0.5))


def test_pack_unpack_round_trip_keeps_every_field_bit_for_bit():
    rng = np.random.default_rng(0)
    for shape in (StepShape(8, 4, 3), StepShape(16, 16, 1)):
        fb = random_batch(shape, rng)
        packed = pack(fb)
        assert packed.dtype == np.int32 and packed.ndim == 1
        unpacked = jax.jit(unpack, static_argnums=1)(packed, shape)
        assert len(packed) == sum(x.size for x in fb[:len(PACKED_FIELDS)])  # the flags stay home
        for name, want, got in zip(PACKED_FIELDS, fb, unpacked):
            got = np.asarray(got)
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert np.array_equal(got.view(np.uint8), np.asarray(want).view(np.uint8)), name


def test_the_samplers_fields_unpack_from_the_front_whatever_the_tokens_and_pages():
    rng = np.random.default_rng(1)
    for shape in (StepShape(32, 4, 5), StepShape(4, 4, 1)):
        fb = random_batch(shape, rng)
        front = pack(fb)[:sampling_size(4)]
        got = jax.jit(unpack_sampling, static_argnums=1)(front, 4)
        assert set(got) == set(SAMPLING_FIELDS) and {"temperature", "banned"} <= set(got)
        for name, value in got.items():
            want = getattr(fb, name)
            assert np.array_equal(np.asarray(value).view(np.uint8), want.view(np.uint8)), name
