"""HuggingFace transformers baseline of the benchmark: the same requests, HF ``generate``.

The baseline loads ``AutoModelForCausalLM`` from the HF-format directory the engine loaded, in the
same dtype, and runs the requests in the dataset's order as static batches of ``batch_size``:
prompts LEFT-padded (with an explicit attention mask, so the pad id never matters), greedy, EOS
ignored, every request of a batch generating the batch's largest ``output_len``. Only each
request's own prompt and its own ``output_len`` tokens are counted, as in the engine's figures:
the tokens a request generates past its ``output_len`` (to keep its batch static) are waste the
baseline pays for, which is exactly what continuous batching saves.

torch and transformers are imported inside :func:`run_hf_baseline` only, so the engine imports
without them. torch's thread count is left at its default: a fair baseline, not a tuned one.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any, Sequence

_DTYPES = ("float32", "bfloat16", "float16")


def _torch_dtype(torch: Any, name: str) -> Any:
    """The torch dtype of a dtype name (the engine's, already resolved from ``auto``)."""
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {name!r}")
    return getattr(torch, name)


def _load(model_dir: str | Path, torch_dtype: Any, device: str) -> Any:
    """The HF model of ``model_dir`` (an alias or a directory), in eval mode on ``device``.

    A dummy alias (config only, no weights) gets random weights of the same shapes: throughput
    does not depend on the weights' values.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from minijax_serve.models.registry import resolve_model

    resolved = resolve_model(model_dir)
    if resolved.dummy:
        config = AutoConfig.from_pretrained(str(resolved.path))
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(resolved.path), dtype=torch_dtype)
    return model.to(device).eval()


def _pad_id(model: Any) -> int:
    """The model's pad token id (its config, then its generation config), else 0."""
    for cfg in (model.config, model.generation_config):
        pad = getattr(cfg, "pad_token_id", None)
        if isinstance(pad, int) and pad >= 0:
            return pad
    return 0


def _left_padded(torch: Any, prompts: Sequence[Sequence[int]], pad_id: int, device: str):
    """(input_ids, attention_mask) of ``prompts`` left-padded to the longest one."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
            mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


def _generate(torch: Any, model: Any, gen_config: Any, prompts: Sequence[Sequence[int]],
              new_tokens: int, pad_id: int, device: str) -> int:
    """Greedy-generate exactly ``new_tokens`` for each of ``prompts`` as one batch; returns the
    number of tokens generated per row (checked to be ``new_tokens``)."""
    ids, mask = _left_padded(torch, prompts, pad_id, device)
    config = copy.deepcopy(gen_config)
    config.max_new_tokens = config.min_new_tokens = new_tokens
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, generation_config=config)
    generated = out.shape[1] - ids.shape[1]
    if generated != new_tokens:
        raise RuntimeError(f"HF generate made {generated} tokens per row, expected {new_tokens}")
    return generated


def run_hf_baseline(model_dir: str | Path, requests: list[tuple[list[int], int]],
                    batch_size: int, dtype: str) -> dict[str, Any]:
    """Time HF ``generate`` over ``requests`` (``(prompt_ids, output_len)``) in static batches.

    Returns the run's duration and request/input/output/total throughput, the counts they come
    from, and how the baseline ran (device, dtype, threads, batches, padding waste).
    """
    import torch
    import transformers

    if batch_size < 1:
        raise ValueError(f"baseline batch size must be >= 1, got {batch_size}")
    if not requests:
        raise ValueError("the baseline needs at least one request")
    for prompt, out_len in requests:
        if not prompt:
            raise ValueError("every baseline prompt needs at least one token")
        if out_len < 1:
            raise ValueError(f"every output_len must be >= 1, got {out_len}")

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_dtype = _torch_dtype(torch, dtype)
    load_start = time.perf_counter()
    model = _load(model_dir, torch_dtype, device)
    load_time = time.perf_counter() - load_start
    pad_id = _pad_id(model)

    gen_config = copy.deepcopy(model.generation_config)
    gen_config.eos_token_id = None  # ignore EOS, as the engine's ignore_eos=True
    gen_config.do_sample = False
    gen_config.pad_token_id = pad_id
    for unused in ("temperature", "top_p", "top_k"):  # greedy: silence sampling-flag warnings
        if hasattr(gen_config, unused):
            setattr(gen_config, unused, None)

    batches = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]

    # Warm-up: one small generate (allocator, kernels, lazy init), not timed.
    first_prompt = list(requests[0][0])[:8]
    _generate(torch, model, gen_config, [first_prompt] * min(2, batch_size), 2, pad_id, device)
    if device == "cuda":
        torch.cuda.synchronize()

    generated_rows = 0
    batch_times: list[tuple[float, float]] = []  # (start, end) of each batch, s from the start
    start = time.perf_counter()
    for batch in batches:
        batch_start = time.perf_counter() - start
        new_tokens = max(out_len for _, out_len in batch)
        generated_rows += len(batch) * _generate(torch, model, gen_config,
                                                 [p for p, _ in batch], new_tokens, pad_id, device)
        if device == "cuda":
            torch.cuda.synchronize()
        batch_times.append((batch_start, time.perf_counter() - start))
    duration = time.perf_counter() - start

    n_in = sum(len(p) for p, _ in requests)
    n_out = sum(o for _, o in requests)
    return {
        "backend": "hf transformers", "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "completed": len(requests), "num_requests": len(requests), "duration_s": duration,
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "request_throughput": len(requests) / duration, "input_throughput": n_in / duration,
        "output_throughput": n_out / duration, "total_throughput": (n_in + n_out) / duration,
        "generated_tokens_incl_padding": generated_rows, "batch_size": batch_size,
        "num_batches": len(batches), "dtype": str(torch_dtype).removeprefix("torch."),
        "device": device, "torch_num_threads": torch.get_num_threads(),
        "load_time_s": load_time, "pad_token_id": pad_id,
        # for plots: every request of a static batch completes when its batch does
        "batch_times_s": batch_times,
        "batch_output_tokens": [sum(o for _, o in batch) for batch in batches],
        "request_finish_s": [end for batch, (_, end) in zip(batches, batch_times)
                             for _ in batch],
    }
