"""FP8 checkpoints in the format vLLM and SGLang read: a ``config.json`` whose
``quantization_config`` has ``quant_method: "fp8"``, and safetensors holding each quantized
linear weight in ``F8_E4M3`` beside its scale:

* ``<module>.weight_scale``: one float32 per tensor (``[]`` or ``[1]``; AutoFP8's and
  llm-compressor's "static"/"dynamic" schemes) or per output channel (``[out]``, ``[out, 1]``),
  with ``weight ≈ q · scale``;
* ``<module>.weight_scale_inv`` with ``weight_block_size: [bo, bi]``: one scale per block of
  ``bo`` output × ``bi`` input channels (DeepSeek's and Qwen3-FP8's), ``weight ≈ q · scale``.

The engine holds one scale per output channel (:mod:`minijax_serve.models.quantize`): a
per-tensor or per-channel checkpoint is taken as stored (a tensor's scale repeated over its
channels), a block-scaled one is dequantised and quantized again per channel (a second
rounding). A linear weight the checkpoint left unquantized (``modules_to_not_convert``) is
quantized here, since every layer of the decoder has one structure. Activation scales
(``input_scale``) and KV-cache scales (``k_scale``, ``v_scale``) are not read: activations are
quantized per token when ``fp8_w8a8`` asks, and the KV cache calibrates its own scales.

The tensors are read by parsing the safetensors header and mapping the file (the ``numpy``
backend of the safetensors package has no FP8 type); :func:`check_scales` reads only headers,
so a checkpoint with a missing scale is refused before any weight is read.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Iterator

import ml_dtypes
import numpy as np

from minijax_serve.core.fp8 import quantize

_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "BF16": ml_dtypes.bfloat16, "F16": np.float16,
           "F32": np.float32, "F64": np.float64}
# the HF names of the decoder's linear modules (models/loader.py's weights, [out, in] each)
LINEAR_MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                  "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
SCALE = ".weight_scale"  # the scale tensors' names as the engine reads them: per output channel


def checkpoint_quantization(model_dir: str | Path) -> dict[str, Any] | None:
    """``config.json``'s ``quantization_config`` if it names FP8 (None without one); ValueError
    for another method, which the engine cannot read."""
    path = Path(model_dir) / "config.json"
    try:
        qconfig = json.loads(path.read_text()).get("quantization_config")
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read the model config: {e}") from e
    if qconfig is None:
        return None
    method = qconfig.get("quant_method") if isinstance(qconfig, dict) else None
    if method != "fp8":
        raise ValueError(f"{path}: quantization_config.quant_method={method!r} is not supported "
                         "(only 'fp8' checkpoints are read)")
    block = qconfig.get("weight_block_size")
    if block is not None and (len(block) != 2 or min(block) < 1):
        raise ValueError(f"{path}: quantization_config.weight_block_size must be two positive "
                         f"ints, got {block!r}")
    return qconfig


def read_header(file: Path) -> tuple[dict[str, dict], int]:
    """A safetensors file's tensors (name -> dtype, shape, data_offsets) and where its data
    starts."""
    with open(file, "rb") as f:
        head = f.read(8)
        size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < size < 100 << 20:
            raise ValueError(f"{file}: not a safetensors file (header size {size})")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header, 8 + size


def _tensor(file: Path, info: dict, start: int) -> np.ndarray:
    dtype = _DTYPES.get(info["dtype"])
    if dtype is None:
        raise ValueError(f"{file}: tensor dtype {info['dtype']} is not supported")
    begin, end = info["data_offsets"]
    data = np.memmap(file, np.uint8, "r", offset=start + begin, shape=(end - begin,))
    return np.array(data.view(dtype).reshape(info["shape"]))


def _headers(files: list[Path]) -> dict[str, tuple[Path, dict, int]]:
    found = {}
    for f in files:
        header, start = read_header(f)
        found |= {name: (f, info, start) for name, info in header.items()}
    return found


def check_scales(files: list[Path], qconfig: dict[str, Any]) -> None:
    """ValueError naming the tensor if an FP8 weight lacks its scale (headers only: nothing
    is read)."""
    tensors = _headers(files)
    want = "weight_scale_inv" if qconfig.get("weight_block_size") else "weight_scale"
    for name, (f, info, _) in tensors.items():
        if info["dtype"] == "F8_E4M3" and name.endswith(".weight"):
            scale = name[:-len("weight")] + want
            if scale not in tensors:
                raise ValueError(f"{f.parent}: FP8 weight {name} has no scale tensor {scale} "
                                 f"(quantization_config.quant_method='fp8'"
                                 f"{', weight_block_size' if want.endswith('inv') else ''} needs "
                                 "one for every FP8 weight)")


def _per_channel(q: np.ndarray, scale: np.ndarray, block: list[int] | None,
                 name: str) -> tuple[np.ndarray, np.ndarray]:
    """(FP8 weight [out, in], float32 scale [out]) from a checkpoint's weight and scale."""
    out, inp = q.shape
    scale = scale.astype(np.float32)
    if block is not None:
        bo, bi = block
        if scale.shape != (-(-out // bo), -(-inp // bi)):
            raise ValueError(f"{name}: weight_scale_inv shape {scale.shape} does not fit weight "
                             f"{q.shape} in blocks of {block}")
        full = np.repeat(np.repeat(scale, bo, axis=0)[:out], bi, axis=1)[:, :inp]
        return quantize(q.astype(np.float32) * full, axis=1)
    if scale.size == 1:
        return q, np.full(out, scale.reshape(()), np.float32)
    if scale.size == out:
        return q, scale.reshape(out)
    raise ValueError(f"{name}: weight_scale of shape {scale.shape} is neither per tensor nor per "
                     f"output channel of weight {q.shape}")


def fp8_tensors(files: list[Path], qconfig: dict[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    """The checkpoint's tensors as (HF name, array): each decoder linear weight in FP8 [out,
    in] with its per-output-channel scale as ``<module>.weight_scale`` [out]; every other
    tensor in float32. Scales are checked first (:func:`check_scales`)."""
    check_scales(files, qconfig)
    block = qconfig.get("weight_block_size")
    tensors = _headers(files)
    skip = (".weight_scale", ".weight_scale_inv", ".input_scale", ".k_scale", ".v_scale")
    for name, (f, info, start) in tensors.items():
        if name.endswith(skip):
            continue
        tensor = _tensor(f, info, start)
        module = name[:-len(".weight")]
        if name.endswith(".weight") and module.endswith(LINEAR_MODULES) and ".layers." in name:
            if info["dtype"] == "F8_E4M3":
                scale_name = module + (".weight_scale_inv" if block else SCALE)
                q, scale = _per_channel(tensor, _tensor(*tensors[scale_name]), block, name)
            else:  # left unquantized by the checkpoint: quantized here
                q, scale = quantize(tensor.astype(np.float32), axis=1)
            yield name, q
            yield module + SCALE, scale
        else:
            yield name, tensor.astype(np.float32)

