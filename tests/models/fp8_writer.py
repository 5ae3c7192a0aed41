"""Write an FP8 checkpoint in the format vLLM and SGLang read, from a float checkpoint: each
decoder linear weight in F8_E4M3 with its scale (``scheme``: ``"tensor"``, one float32 per
tensor as AutoFP8 writes it; ``"channel"``, one per output row, [out, 1]; ``"block"``, DeepSeek's
``weight_scale_inv`` per block, 128 x 128 by default), ``config.json``'s ``quantization_config``, every other
file copied."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from minijax_serve.core.fp8 import quantize, to_fp8
from minijax_serve.models.fp8_checkpoint import LINEAR_MODULES

BLOCK = 128


def _block_scales(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    out, inp = w.shape
    rows, cols = -(-out // block), -(-inp // block)
    padded = np.zeros((rows * block, cols * block), np.float32)
    padded[:out, :inp] = w
    amax = np.abs(padded.reshape(rows, block, cols, block)).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
    full = np.repeat(np.repeat(scale, block, axis=0)[:out], block, axis=1)[:, :inp]
    return to_fp8(w, full), scale


def write_fp8_checkpoint(src: Path, dst: Path, scheme: str = "tensor", block: int = BLOCK,
                         drop_scale: str | None = None) -> Path:
    """``src`` (one model.safetensors) as an FP8 checkpoint in ``dst``; ``block``: the blocks'
    side (``"block"``); ``drop_scale``: the name of a scale tensor to leave out (a broken
    checkpoint)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    tensors = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        module = name[:-len(".weight")]
        if not (name.endswith(".weight") and module.endswith(LINEAR_MODULES)):
            tensors[name] = w
            continue
        w = w.astype(np.float32)
        if scheme == "tensor":
            scale = np.float32(np.abs(w).max() / 448.0)
            q, scale = to_fp8(w, scale), np.asarray(scale, np.float32)
        elif scheme == "channel":
            q, scale = quantize(w, axis=1)
            scale = scale[:, None]
        else:
            q, scale = _block_scales(w, block)
        tensors[name] = q
        tensors[module + (".weight_scale_inv" if scheme == "block" else ".weight_scale")] = scale
    if drop_scale is not None:
        del tensors[drop_scale]
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    if scheme == "block":
        config["quantization_config"]["weight_block_size"] = [block, block]
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
