"""Kernel tuning as data: each kernel's tile sizes, warps and stages in a table keyed by device
kind, dtype, query heads, KV heads, head dim and page size (``<kernel>.json`` beside this file);
in the same way, ``decode_routing.json`` says, per attention backend with a decode kernel,
whether its ragged kernel takes the decode-only steps instead (``benchmarks/kernels/
bench_kernels.py --grid --write-tuning`` writes it from the decode grid).

A row is a key (each field a value, or ``"*"`` for any) and the kernel keyword arguments it
chooses, with where the choice came from. :func:`lookup` takes the most specific row that
matches a call (the most non-``"*"`` fields; the earlier row on a tie). ``benchmarks/kernels/
kernel_sweeps.py --write-tuning`` adds or replaces the row of the shape it swept with its
fastest variant (:func:`write_row`); the first rows are the choices measured before the table
existed (benchmarks/RESULTS.md, "Pallas attention kernels on an H200").
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

KEY_FIELDS = ("device_kind", "dtype", "num_heads", "kv_heads", "head_dim", "page_size")
KERNELS = ("ragged_paged_attention", "paged_decode_attention", "ragged_paged_attention_mgpu",
           "decode_routing")
TABLE_DIR = Path(__file__).parent


def table_path(kernel: str, directory: Path = TABLE_DIR) -> Path:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    return directory / f"{kernel}.json"


@functools.cache
def _rows(kernel: str) -> tuple[dict[str, Any], ...]:
    return tuple(json.loads(table_path(kernel).read_text())["rows"])


def match(rows, key: dict[str, Any]) -> dict[str, Any]:
    """The params of the most specific row of ``rows`` matching ``key`` ({} if none does)."""
    best, best_score = None, -1
    for row in rows:
        fields = [row["key"].get(f, "*") for f in KEY_FIELDS]
        if all(v == "*" or v == key[f] for f, v in zip(KEY_FIELDS, fields)):
            score = sum(v != "*" for v in fields)
            if score > best_score:
                best, best_score = row, score
    return {} if best is None else dict(best["params"])


def lookup(kernel: str, device_kind: str, dtype: str, num_heads: int, kv_heads: int,
           head_dim: int, page_size: int) -> dict[str, Any]:
    """The keyword arguments of ``kernel`` for a call of these shapes on ``device_kind``."""
    key = dict(zip(KEY_FIELDS, (device_kind, dtype, num_heads, kv_heads, head_dim, page_size)))
    return match(_rows(kernel), key)


def write_row(kernel: str, key: dict[str, Any], params: dict[str, Any], source: str,
              directory: Path = TABLE_DIR) -> Path:
    """Add the row of ``key`` (every key field given) to ``kernel``'s table, replacing a row of
    the same key; returns the table's path."""
    if set(key) != set(KEY_FIELDS):
        raise ValueError(f"a tuning row's key has the fields {', '.join(KEY_FIELDS)}, got "
                         f"{', '.join(key)}")
    path = table_path(kernel, directory)
    table = json.loads(path.read_text())
    rows = [r for r in table["rows"] if r["key"] != key]
    table["rows"] = rows + [{"key": key, "params": params, "source": source}]
    path.write_text(json.dumps(table, indent=1) + "\n")
    _rows.cache_clear()
    return path
