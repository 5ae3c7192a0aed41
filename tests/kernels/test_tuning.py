"""The kernels' tuning tables (pallas_kernels/tuning): the most specific matching row wins, every
table has a default row, and every row's keywords are ones its kernel takes."""

from __future__ import annotations

import inspect

import pytest

from pallas_kernels import tuning
from pallas_kernels.paged_decode_attention import paged_decode_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.ragged_paged_attention_mgpu import ragged_paged_attention_mgpu

KERNELS = {"paged_decode_attention": paged_decode_attention,
           "ragged_paged_attention": ragged_paged_attention,
           "ragged_paged_attention_mgpu": ragged_paged_attention_mgpu}
ANY = dict.fromkeys(tuning.KEY_FIELDS, "*")
KEY = dict(device_kind="NVIDIA H200", dtype="bfloat16", num_heads=16, kv_heads=8, head_dim=128,
           page_size=16)


def test_the_most_specific_matching_row_wins():
    rows = [{"key": ANY, "params": {"block_kv": 64}},
            {"key": {**ANY, "device_kind": "NVIDIA H200"}, "params": {"block_kv": 128}},
            {"key": {**ANY, "device_kind": "NVIDIA H200", "head_dim": 128},
             "params": {"block_kv": 32}},
            {"key": {**ANY, "head_dim": 64, "dtype": "bfloat16"}, "params": {"block_kv": 16}}]
    assert tuning.match(rows, KEY) == {"block_kv": 32}
    assert tuning.match(rows, {**KEY, "head_dim": 256}) == {"block_kv": 128}
    assert tuning.match(rows, {**KEY, "device_kind": "cpu", "head_dim": 64}) == {"block_kv": 16}
    assert tuning.match(rows, {**KEY, "device_kind": "cpu"}) == {"block_kv": 64}
    assert tuning.match(rows[1:2], {**KEY, "device_kind": "cpu"}) == {}


def _taken(kernel: str) -> set[str]:
    """The keywords a table's rows may set: its kernel's, or for the decode routing the backends
    with a decode kernel (each row saying whether its ragged kernel takes decode-only steps)."""
    if kernel == "decode_routing":
        from minijax_serve.attention.registry import BACKENDS
        return {name for name, backend in BACKENDS.items() if backend.decode_kernel}
    return set(inspect.signature(KERNELS[kernel]).parameters)


@pytest.mark.parametrize("kernel", tuning.KERNELS)
def test_every_table_has_a_default_and_rows_the_kernel_takes(kernel):
    taken = _taken(kernel)
    rows = tuning._rows(kernel)
    assert any(row["key"] == ANY for row in rows), "a row for every device and shape"
    for row in rows:
        assert set(row["key"]) == set(tuning.KEY_FIELDS) and row["source"]
        assert set(row["params"]) <= taken, row
        if kernel == "decode_routing":
            assert set(row["params"]) == taken and all(
                isinstance(v, bool) for v in row["params"].values()), row
    assert tuning.lookup(kernel, "cpu", "float32", 4, 2, 64, 8) == next(
        row["params"] for row in rows if row["key"] == ANY)


def test_a_row_needs_every_key_field(tmp_path):
    with pytest.raises(ValueError, match="fields"):
        tuning.write_row("paged_decode_attention", {"device_kind": "x"}, {}, "", tmp_path)
    with pytest.raises(ValueError, match="kernel must be one of"):
        tuning.table_path("flash")
