"""HuggingFace transformers as the reference: tiny random models and greedy generations."""

from __future__ import annotations

from pathlib import Path

import numpy as np

MIN_TOP2_GAP = 1e-3  # float32 rounding noise is ~1e-6; ties below this would make equality luck


def tiny_config(family: str):
    import transformers as tf

    common = dict(num_hidden_layers=2, max_position_embeddings=128, initializer_range=0.25,
                  rms_norm_eps=1e-6)
    if family == "llama":  # GQA 1, head_dim 16, untied
        return tf.LlamaConfig(vocab_size=301, hidden_size=64, intermediate_size=128,
                              num_attention_heads=4, num_key_value_heads=4,
                              tie_word_embeddings=False, **common)
    if family == "qwen2":  # q/k/v bias, GQA 3, head_dim 32, tied
        return tf.Qwen2Config(vocab_size=263, hidden_size=96, intermediate_size=160,
                              num_attention_heads=3, num_key_value_heads=1,
                              tie_word_embeddings=True, **common)
    if family == "qwen3":  # q/k norm, head_dim 64 with heads * head_dim != hidden, GQA 3
        return tf.Qwen3Config(vocab_size=311, hidden_size=64, intermediate_size=128,
                              num_attention_heads=6, num_key_value_heads=2, head_dim=64,
                              tie_word_embeddings=False, **common)
    if family == "mistral":  # GQA 3, head_dim 16, no sliding window
        return tf.MistralConfig(vocab_size=277, hidden_size=96, intermediate_size=192,
                                num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                                sliding_window=None, tie_word_embeddings=False, **common)
    raise ValueError(family)


def save_tiny_model(family: str, path: Path, seed: int = 0, **save_kwargs) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family), torch_dtype=torch.float32)
    with torch.no_grad():  # norms and biases away from their trivial init, for a real test
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
        model.model.norm.weight.mul_(8.0)  # spread the logits: clear top-1/top-2 gaps
    model.save_pretrained(path, **save_kwargs)
    return path


def load_hf(path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


def logits(path, prompt: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return load_hf(path)(torch.tensor([prompt])).logits[0].numpy()


_GREEDY: dict[tuple, tuple[list[int], list[float]]] = {}  # (model, prompt) -> tokens, gaps
_KEEP: list = []  # models keyed by id() stay alive, so their ids are never reused


def _model_key(path, model) -> tuple:
    if model is not None:
        if not any(m is model for m in _KEEP):
            _KEEP.append(model)
        return ("model", id(model))
    config = Path(path) / "config.json"
    return ("path", str(Path(path).resolve()), config.stat().st_mtime_ns if config.exists() else 0)


def greedy(path, prompts: list[list[int]], max_new_tokens: int, model=None,
           skip_near_ties: bool = False) -> list[list[int] | None]:
    """HF greedy generation of each prompt, ignoring EOS; asserts clear top-1/top-2 gaps (or,
    with ``skip_near_ties``, gives None for a prompt whose generation has a near-tie).

    Generations are kept for the session, per model and prompt: greedy decoding is a prefix of
    any longer one, so a later call for as many tokens or fewer reads it instead of running HF.
    The prompts not kept yet run in left-padded batches (``_generate``)."""
    key = _model_key(path, model)
    todo = [p for p in dict.fromkeys(map(tuple, prompts))
            if len(_GREEDY.get((key, p), ((),))[0]) < max_new_tokens]
    if todo:
        model = model or load_hf(path)
        for i in range(0, len(todo), BATCH):
            for p, done in zip(todo[i:i + BATCH], _generate(model, todo[i:i + BATCH],
                                                             max_new_tokens)):
                _GREEDY[(key, p)] = done
    outs = []
    for p in prompts:
        tokens, gaps = (x[:max_new_tokens] for x in _GREEDY[(key, tuple(p))])
        if min(gaps) <= MIN_TOP2_GAP:
            assert skip_near_ties, "reference has an argmax near-tie"
            outs.append(None)
            continue
        outs.append(tokens)
    return outs


# Prompts of one HF generate call. A decode step reads every weight once, whatever the batch:
# SmolLM2's 16 test prompts x 16 tokens took 20.5 s one by one and 5.4 s in one batch (1 CPU
# thread); the same tokens as one by one for the tiny models and SmolLM2, their logits within
# 3.1e-4 (the matmuls' summation order differs with the batch size), below MIN_TOP2_GAP / 2.
BATCH = 32


def _generate(model, prompts: list[tuple[int, ...]],
              max_new_tokens: int) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and top-1/top-2 logit gaps of each prompt: one generate call, the prompts
    left-padded (masked out; id 0 is a real token here, so the mask is explicit)."""
    import torch

    torch.set_num_threads(1)  # tiny ops: thread hand-offs cost more than they save
    model.generation_config.eos_token_id = None  # ignore EOS, as the engine's ignore_eos
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.no_grad():
        res = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0)
    top2 = torch.stack([torch.topk(x, 2).values for x in res.logits], 1)  # [batch, steps, 2]
    gaps = (top2[..., 0] - top2[..., 1]).tolist()
    return [(res.sequences[i, width:].tolist(), gaps[i]) for i in range(len(prompts))]


def log_softmax_rows(model, ids: list[int], start: int) -> np.ndarray:
    """HF's float32 log-softmax at positions ``start - 1 ..`` of ``ids`` (teacher-forced): row
    i is the distribution of token ``ids[start + i]``."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, start - 1:len(ids) - 1]
        return torch.log_softmax(logits.float(), dim=-1).numpy()


def assert_logprobs_match(ours: list[dict[int, float]], chosen: list[int], ref: np.ndarray,
                          k: int, atol: float = 1e-4, rtol: float = 1e-5) -> None:
    """Each of ``ours`` (the chosen token first, then the top ``k``) against HF's rows ``ref``:
    every value within ``atol + rtol * |value|`` (float32's error grows with the logits: the
    tiny models' tails reach -13, where XLA's code at -O0 and at -O2 differ from HF by up to
    1.1e-4 and 7.6e-5), and the top-k ids identical at each rank whose gaps to both neighbours
    exceed MIN_TOP2_GAP (closer values may swap under float32 noise)."""
    assert len(ours) == len(chosen) == len(ref)
    for lp, token, row in zip(ours, chosen, ref):
        assert next(iter(lp)) == token
        for t, v in lp.items():
            assert abs(v - row[t]) <= atol + rtol * abs(row[t]), (t, v, row[t])
        ids = [t for t, _ in sorted(lp.items(), key=lambda kv: -kv[1])[:k]]
        top = np.argsort(-row, kind="stable")[:k + 1]
        for j in range(k):
            gap_before = j == 0 or row[top[j - 1]] - row[top[j]] > MIN_TOP2_GAP
            if gap_before and row[top[j]] - row[top[j + 1]] > MIN_TOP2_GAP:
                assert ids[j] == top[j], (j, ids, top)
