"""Model loading and the decoder's numerics, checked against HuggingFace transformers.

- logits of every position equal HF's (1e-4 relative) for every tiny family, through the paged KV
  path (page sizes 1 and 16, scrambled pages, stale garbage in the pools), both as one batched
  prefill of whole prompts and as a short prefill followed by token-by-token decode steps;
- dummy weights and the shape-only aliases; a step reads each layer's weights in place
  (config parsing and broken inputs: test_model_config.py; sharded safetensors and the Orbax
  load cache: test_weight_files.py).
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minijax_serve.attention.layer import AttentionMetadata, PagedAttention
from minijax_serve.models.config import load_model_config, model_config_from_dict
from minijax_serve.models.decoder import DecoderLM
from minijax_serve.models.loader import load_model
from minijax_serve.models.protocol import forward
from minijax_serve.models.registry import resolve_model
from tests import hf_reference
from tests.conftest import FAMILIES
from tests.models.test_model_config import BASE, abstract_param_count

CONFIGS = Path(__file__).resolve().parents[2] / "minijax_serve" / "models" / "configs"
RTOL = 1e-4
PROMPT_LENGTHS = (1, 9, 40)
# prefill length of each prompt in the split check; the rest is fed one token at a time
# (1 -> 0: decoded from an empty cache; 40 -> 32: the first decode token opens a new page of 16)
SPLIT_AT = (0, 4, 32)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(0, 250, size=n).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def hf_logits(tiny_dir, prompts):
    """family -> HF logits [len, vocab] of every prompt (each prompt run alone)."""
    import torch

    out = {}
    for family in FAMILIES:
        model = hf_reference.load_hf(tiny_dir[family])
        with torch.no_grad():
            out[family] = [model(torch.tensor([p])).logits[0].numpy() for p in prompts]
    return out


@pytest.fixture(scope="module")
def loaded(tiny_dir):
    """family -> LoadedModel from safetensors (no cache), loaded once per module."""
    return {f: load_model(tiny_dir[f], use_cache=False) for f in FAMILIES}


# --------------------------------------------------------------------------------------------
# helpers: a hand-built paged KV cache fed with fixed-shape steps


@functools.partial(jax.jit, static_argnums=(0, 6))
def _forward(graphdef, state, ids, meta, k_pool, v_pool, layer_loop="scan"):
    model = nnx.merge(graphdef, state)
    logits, attn = forward(model, ids, PagedAttention(k_pool, v_pool, meta),
                           jnp.arange(ids.shape[0]), layer_loop)
    return logits, attn.k_pool, attn.v_pool


class PagedKV:
    """Sequences of known final lengths in paged K/V pools, fed through the engine's ``forward``.

    Pages are handed out shuffled (non-contiguous), the pools start full of large finite garbage
    (stale KV that masking must keep out), and page-table entries past a sequence's pages point at
    other sequences' pages. Every step has the same shapes (so one compilation serves prefill and
    decode): ``sum(lengths)`` token rows, the real new tokens first and then padding rows that
    belong to an extra scratch sequence writing into a scratch page nobody else owns.
    """

    def __init__(self, model: DecoderLM, lengths, page_size: int, seed: int,
                 layer_loop: str = "scan"):
        rng = np.random.default_rng(seed)
        self.layer_loop = layer_loop
        cfg = model.cfg
        self.graphdef, self.state = nnx.split(model)
        self.page_size, self.num_tokens = page_size, int(sum(lengths))
        needed = [-(-n // page_size) for n in lengths]
        owned = sum(needed)
        self.num_pages = owned + 4  # + the scratch page + 3 pages nobody owns
        perm = rng.permutation(self.num_pages)
        self.scratch = int(perm[owned])
        self.tables = np.zeros((len(lengths) + 1, max(needed)), np.int32)
        start = 0
        for s, n in enumerate(needed):
            self.tables[s, :n] = perm[start:start + n]
            start += n
            others = np.setdiff1d(perm[:owned], self.tables[s, :n])
            pool = others if others.size else perm[:owned]
            self.tables[s, n:] = rng.choice(pool, self.tables.shape[1] - n)
        self.tables[-1] = self.scratch
        assert any(np.any(np.diff(t[:n]) != 1) for t, n in zip(self.tables, needed) if n > 1)
        self.kv_lens = np.zeros(len(lengths), np.int32)
        shape = (cfg.num_layers, cfg.num_kv_heads, self.num_pages, page_size, cfg.head_dim)
        self.initial = [rng.normal(0, 30, shape).astype(np.float32) for _ in range(2)]
        self.k_pool, self.v_pool = (jnp.asarray(p) for p in self.initial)

    def slots(self, s: int, positions: np.ndarray) -> np.ndarray:
        ps = self.page_size
        return self.tables[s][positions // ps] * ps + positions % ps

    def step(self, chunks) -> list[np.ndarray]:
        """Append ``tokens`` to the KV of each ``(seq, tokens)`` in one call; returns each
        chunk's logits rows [len(tokens), vocab] (none for an empty chunk)."""
        chunks = [(s, list(toks)) for s, toks in chunks]
        ids, positions, seq_ids, slots = [], [], [], []
        for s, toks in chunks:
            pos = self.kv_lens[s] + np.arange(len(toks))
            ids += toks
            positions.append(pos)
            seq_ids.append(np.full(len(toks), s))
            slots.append(self.slots(s, pos))
            self.kv_lens[s] += len(toks)
        pad = self.num_tokens - len(ids)
        assert pad >= 0
        scratch_seq = len(self.kv_lens)
        ids += [0] * pad
        positions.append(np.zeros(pad, np.int64))
        seq_ids.append(np.full(pad, scratch_seq))
        slots.append(np.full(pad, self.scratch * self.page_size))
        cat = lambda xs: jnp.asarray(np.concatenate(xs).astype(np.int32))  # noqa: E731
        q_lens = np.zeros(len(self.kv_lens) + 1, np.int32)  # the padding rows count for nobody
        for s, toks in chunks:
            q_lens[s] = len(toks)
        meta = AttentionMetadata(
            positions=cat(positions),
            seq_ids=cat(seq_ids),
            slot_mapping=cat(slots),
            cu_q_lens=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)),
            page_table=jnp.asarray(self.tables),
            kv_lens=jnp.asarray(np.append(self.kv_lens, 1).astype(np.int32)),
        )
        logits, self.k_pool, self.v_pool = _forward(
            self.graphdef, self.state, jnp.asarray(np.array(ids, np.int32)), meta,
            self.k_pool, self.v_pool, self.layer_loop)
        assert logits.dtype == jnp.float32
        logits = np.asarray(logits)
        offsets = np.cumsum([0] + [len(t) for _, t in chunks])
        return [logits[a:b] for a, b in zip(offsets[:-1], offsets[1:])]

    def assert_no_stray_writes(self):
        """Only the sequences' own slots (and the scratch page) were written."""
        written = [self.slots(s, np.arange(n)) for s, n in enumerate(self.kv_lens)]
        written.append(self.scratch * self.page_size + np.arange(self.page_size))
        keep = np.ones(self.num_pages * self.page_size, bool)
        keep[np.concatenate(written)] = False

        def flat(p):  # [layers, kv_heads, pages, page_size, D] -> [slots, layers, kv_heads, D]
            return np.moveaxis(p.reshape(*p.shape[:2], -1, p.shape[-1]), 2, 0)

        for pool, initial in zip((self.k_pool, self.v_pool), self.initial):
            pool = np.asarray(pool)
            assert pool.shape == initial.shape
            np.testing.assert_array_equal(flat(pool)[keep], flat(initial)[keep])
            assert not np.array_equal(flat(pool)[~keep], flat(initial)[~keep])


def assert_close(ours, ref, what: str):
    ours = np.asarray(ours)
    assert ours.shape == ref.shape, what
    assert np.all(np.isfinite(ours)), what
    # every position on its own: diff / largest reference logit of that position
    rel = np.abs(ours - ref).max(axis=-1) / np.abs(ref).max(axis=-1)
    assert rel.max() < RTOL, f"{what}: relative error {rel.max():.2e} at position {rel.argmax()}"


# --------------------------------------------------------------------------------------------
# 1. logits equal HF's through the paged KV path


@pytest.mark.parametrize("page_size, layer_loop", [(1, "scan"), (16, "scan"), (16, "unroll")])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_hf_paged(family, page_size, layer_loop, loaded, prompts, hf_logits):
    model = loaded[family].model
    refs = hf_logits[family]
    lengths = [len(p) for p in prompts]

    # one batched prefill of every whole prompt
    kv = PagedKV(model, lengths, page_size, seed=page_size, layer_loop=layer_loop)
    for s, got in enumerate(kv.step(enumerate(prompts))):
        assert_close(got, refs[s], f"{family} ps={page_size} prefill len={lengths[s]}")
    kv.assert_no_stray_writes()

    # split: prefill the first part of each prompt together, then decode the rest one token per
    # sequence per step, each step reading the earlier KV from the pools
    kv = PagedKV(model, lengths, page_size, seed=100 + page_size, layer_loop=layer_loop)
    got = kv.step((s, p[:k]) for s, (p, k) in enumerate(zip(prompts, SPLIT_AT)))
    got = [[g] for g in got]
    while np.any(kv.kv_lens < lengths):
        todo = [s for s in range(len(prompts)) if kv.kv_lens[s] < lengths[s]]
        rows = kv.step((s, [prompts[s][kv.kv_lens[s]]]) for s in todo)
        for s, row in zip(todo, rows):
            assert row.shape[0] == 1
            got[s].append(row)
    for s, ref in enumerate(refs):
        assert_close(np.concatenate(got[s]), ref,
                     f"{family} ps={page_size} prefill {SPLIT_AT[s]} + decode, len={lengths[s]}")
    kv.assert_no_stray_writes()


# --------------------------------------------------------------------------------------------
# 4. dummy weights and the shape-only aliases


def test_llama3_8b_alias_shapes():
    resolved = resolve_model("llama-3-8b")
    assert resolved.dummy and resolved.path == CONFIGS / "llama-3-8b"
    cfg = load_model_config(resolved.path)
    total, shapes = abstract_param_count(cfg)
    assert total == cfg.num_params()
    assert abs(total - 8.03e9) < 0.005e9, total
    assert shapes["embed_tokens"] == (128256, 4096) and shapes["lm_head"] == (4096, 128256)
    assert shapes["layers.31.wk"] == (4096, 1024)  # 8 KV heads of 128
    assert shapes["layers.31.w_down"] == (14336, 4096) and "layers.32.wk" not in shapes


def test_qwen3_06b_alias_head_dim_not_hidden_over_heads():
    resolved = resolve_model("qwen3-0.6b")
    assert resolved.dummy
    cfg = load_model_config(resolved.path)
    assert cfg.head_dim == 128 != cfg.hidden_size // cfg.num_heads
    assert cfg.qk_norm and cfg.tie_word_embeddings and cfg.q_size == 2048
    total, shapes = abstract_param_count(cfg)
    assert total == cfg.num_params() and abs(total - 0.596e9) < 0.005e9, total
    assert shapes["layers.27.wq"] == (1024, 2048) and shapes["layers.27.wo"] == (2048, 1024)
    assert "lm_head" not in shapes


def test_dummy_weights_need_only_a_config(tiny_dir, tmp_path):
    shutil.copy(tiny_dir["llama"] / "config.json", tmp_path / "config.json")  # no weights
    lm = load_model(tmp_path, load_format="dummy")
    assert lm.source == "dummy" and lm.config == load_model_config(tiny_dir["llama"])
    # a forward pass (same shapes as the llama HF comparison: that compilation is reused)
    kv = PagedKV(lm.model, PROMPT_LENGTHS, 16, seed=0)
    rows = kv.step((s, range(n)) for s, n in enumerate(PROMPT_LENGTHS))
    assert [r.shape for r in rows] == [(n, lm.config.vocab_size) for n in PROMPT_LENGTHS]
    assert all(np.all(np.isfinite(r)) and np.ptp(r) > 0 for r in rows)
    # the weights are random, not read from anywhere: a different seed gives different ones
    other = load_model(tmp_path, load_format="dummy", seed=1).model
    assert not np.array_equal(np.asarray(lm.model.embed_tokens[...]), np.asarray(other.embed_tokens[...]))
    # with an explicit config no directory is needed at all
    assert load_model(None, load_format="dummy", config=lm.config).config == lm.config


# --------------------------------------------------------------------------------------------
# 7. a step reads the weights where they are

@pytest.mark.parametrize("layer_loop", ["scan", "unroll"])
def test_a_step_reads_each_layers_weights_in_place(layer_loop):
    # wide layers, few tokens: a copy of one layer's matrices would dwarf everything else the
    # step allocates (slicing weights stacked along a layer axis made such a copy every layer)
    cfg = model_config_from_dict({**BASE, "vocab_size": 256, "intermediate_size": 1024})
    model = DecoderLM(cfg, rngs=nnx.Rngs(0))
    layer_matrix_bytes = sum(w.nbytes for w in model.layers[0].values() if w.ndim == 2)
    graphdef, state = nnx.split(model)
    t, pages, page_size = 4, 8, 16
    pool = jnp.zeros((cfg.num_layers, cfg.num_kv_heads, pages, page_size, cfg.head_dim))
    i32 = functools.partial(jnp.arange, dtype=jnp.int32)
    meta = AttentionMetadata(positions=i32(t), seq_ids=i32(t), slot_mapping=i32(t) * page_size,
                             cu_q_lens=i32(t + 1), page_table=i32(t)[:, None], kv_lens=i32(t) + 1)
    compiled = _forward.lower(graphdef, state, i32(t), meta, pool, pool, layer_loop).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < layer_matrix_bytes / 4, (temp, layer_matrix_bytes)
