"""Weights: HuggingFace safetensors (single or sharded) into the NNX model, random ``dummy``
weights from a config alone, and an Orbax checkpoint of the converted state as a load cache.

Only safetensors are read here (GGUF is converted to safetensors by ``gguf_convert``): never
pickle, never remote code.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from minijax_serve.models.config import ModelConfig, load_model_config
from minijax_serve.models.decoder import DecoderLM, layer_param_shapes
from minijax_serve.models.fp8_checkpoint import check_scales, checkpoint_quantization, fp8_tensors
from minijax_serve.models.quantize import check_method, quantize_model, scale_name

CACHE_FORMAT_VERSION = 3  # 2: one array per layer and weight (was stacked); 3: embed_tokens

# per-layer parameter -> (HF name pattern, transpose?)
_HF_LAYER_NAMES = {
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "bq": ("self_attn.q_proj.bias", False),
    "bk": ("self_attn.k_proj.bias", False),
    "bv": ("self_attn.v_proj.bias", False),
    "bo": ("self_attn.o_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
    "b_gate": ("mlp.gate_proj.bias", False),
    "b_up": ("mlp.up_proj.bias", False),
    "b_down": ("mlp.down_proj.bias", False),
}


class LoadedModel(NamedTuple):
    model: DecoderLM
    config: ModelConfig
    source: str  # "safetensors", "safetensors-fp8", "orbax-cache" or "dummy"
    load_time_s: float


def cache_root() -> Path:
    return Path(os.environ.get("MINIJAX_SERVE_CACHE", Path.home() / ".cache" / "minijax_serve"))


def safetensors_files(model_dir: Path, within: Path | None = None) -> list[Path]:
    """The weight files of a model directory: the sharded index's files, or model.safetensors
    (``within``: a ValueError for a file the index names outside it, before it is looked at)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = list(dict.fromkeys(weight_map.values()))
            if not all(isinstance(name, str) for name in names):
                raise TypeError("its weight_map's values must be file names")
        except (OSError, json.JSONDecodeError, KeyError, AttributeError, TypeError) as e:
            raise ValueError(f"{index}: cannot read the shard index: {e}") from e
        files = [model_dir / name for name in names]
        for f in files if within is not None else ():
            if not f.resolve().is_relative_to(within):
                raise ValueError(f"{f.name} leads out of {within}")
    else:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{model_dir}: no *.safetensors weight file in the model directory")
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{f}: weight file listed in the shard index is missing")
    return files


def _read_tensors(files: list[Path]) -> Iterator[tuple[str, np.ndarray]]:
    from safetensors import SafetensorError
    from safetensors.numpy import safe_open

    for f in files:
        try:
            with safe_open(str(f), framework="numpy") as reader:
                for name in reader.keys():
                    yield name, reader.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"{f}: unreadable safetensors weight file: {e}") from e


def _to_numpy_float(t: np.ndarray) -> np.ndarray:
    """bfloat16 tensors come from safetensors.numpy as raw uint16-backed ml_dtypes arrays."""
    return t.astype(np.float32) if t.dtype != np.float32 else t


def _hf_state(cfg: ModelConfig, files: list[Path],
              tensors: Iterable[tuple[str, np.ndarray]] | None = None) -> dict[str, np.ndarray]:
    """Arrange HF tensors as the model's parameters: the files' tensors in float32 numpy, or
    ``tensors`` as given (an FP8 checkpoint's: FP8 linear weights, each with its per-channel
    ``weight_scale``, which become ``<ours>_scale``)."""
    names = dict(_HF_LAYER_NAMES)
    shapes = layer_param_shapes(cfg)
    if tensors is None:
        tensors = ((name, _to_numpy_float(t)) for name, t in _read_tensors(files))
    else:  # an FP8 checkpoint: the linear weights' scales too
        linear = [n for n in shapes if _HF_LAYER_NAMES[n][1]]
        names |= {scale_name(n): (_HF_LAYER_NAMES[n][0] + "_scale", False) for n in linear}
        shapes = shapes | {scale_name(n): () for n in linear}
    layers = {n: [None] * cfg.num_layers for n in shapes}
    state: dict[str, np.ndarray] = {}
    for name, tensor in tensors:
        if name == "model.embed_tokens.weight":
            state["embed_tokens"] = tensor
        elif name == "model.norm.weight":
            state["final_norm"] = tensor
        elif name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                state["lm_head"] = tensor.T
        elif name.startswith("model.layers."):
            idx, rest = name[len("model.layers."):].split(".", 1)
            if int(idx) >= cfg.num_layers:
                raise ValueError(
                    f"{files[0].parent}: weight {name} is for layer {idx}, but the config has "
                    f"num_hidden_layers={cfg.num_layers}"
                )
            for ours, (hf, transpose) in names.items():
                if rest == hf and ours in shapes:
                    layers[ours][int(idx)] = tensor.T if transpose else tensor
    for n, per_layer in layers.items():
        missing = [i for i, t in enumerate(per_layer) if t is None]
        if missing:
            raise ValueError(f"{files[0].parent}: weight {names[n][0]} missing for layers {missing}")
        state |= {f"layers.{i}.{n}": t for i, t in enumerate(per_layer)}
    for needed in ["embed_tokens", "final_norm"] + ([] if cfg.tie_word_embeddings else ["lm_head"]):
        if needed not in state:
            raise ValueError(f"{files[0].parent}: weight for {needed!r} missing in the safetensors files")
    return state


def _abstract_model(cfg: ModelConfig, dtype,
                    quantization: str | None = None) -> tuple[nnx.GraphDef, nnx.State]:
    abstract = nnx.eval_shape(lambda: DecoderLM(cfg, dtype=dtype, rngs=nnx.Rngs(0),
                                                quantization=quantization))
    return nnx.split(abstract)


def _assign(cfg: ModelConfig, arrays: dict[str, np.ndarray], dtype,
            quantization: str | None = None) -> DecoderLM:
    """The model of ``arrays``, each in its parameter's dtype (``dtype``; FP8 weights and their
    float32 scales with ``quantization``)."""
    graphdef, state = _abstract_model(cfg, dtype, quantization)
    flat = dict(nnx.to_flat_state(state))
    for path, var in flat.items():
        key = ".".join(str(p) for p in path)
        value = arrays[key]
        expected = var.get_value().shape
        if value.shape != expected:
            raise ValueError(f"weight {key}: shape {value.shape}, config expects {expected}")
        var.set_value(jnp.asarray(value, dtype=var.get_value().dtype))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _cache_key(model_dir: Path, files: list[Path], dtype) -> str:
    h = hashlib.sha256(f"v{CACHE_FORMAT_VERSION}|{model_dir.resolve()}|{jnp.dtype(dtype).name}".encode())
    for f in [model_dir / "config.json", *files]:
        st = f.stat()
        h.update(f"|{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:24]


def _restore_cached(path: Path, cfg: ModelConfig, dtype) -> DecoderLM:
    import orbax.checkpoint as ocp

    graphdef, abstract = _abstract_model(cfg, dtype)
    with ocp.StandardCheckpointer() as ckpt:
        state = ckpt.restore(path.resolve(), nnx.to_pure_dict(abstract))
    nnx.replace_by_pure_dict(abstract, state)
    return nnx.merge(graphdef, abstract)


def _save_cached(path: Path, model: DecoderLM) -> None:
    import orbax.checkpoint as ocp

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp.resolve(), nnx.to_pure_dict(nnx.state(model)))
    try:
        os.replace(tmp, path)
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process cached the same weights first


def load_model(
    model_dir: str | Path | None,
    *,
    dtype=jnp.float32,
    load_format: str = "auto",
    config: ModelConfig | None = None,
    use_cache: bool = True,
    seed: int = 0,
    quantization: str | None = None,
) -> LoadedModel:
    """Load a decoder from an HF-format directory, or build one with random ``dummy`` weights.

    With ``load_format="auto"`` the converted state is cached as an Orbax checkpoint under
    ``$MINIJAX_SERVE_CACHE/orbax`` and later loads restore it instead of parsing safetensors.
    ``quantization`` ("fp8", "fp8_w8a8"): the layers' linear weights quantized to FP8 once
    loaded (:mod:`minijax_serve.models.quantize`). An FP8 checkpoint (``quant_method: "fp8"``)
    is read as stored, its scales checked before any weight is read, and not cached.
    """
    start = time.perf_counter()
    check_method(quantization)
    if load_format == "dummy":
        cfg = config or load_model_config(model_dir)
        model = DecoderLM(cfg, dtype=dtype, rngs=nnx.Rngs(seed), quantization=quantization)
        return LoadedModel(model, cfg, "dummy", time.perf_counter() - start)
    if load_format not in ("auto", "safetensors"):
        raise ValueError(f"load_format {load_format!r} is not supported (auto, safetensors, dummy)")
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{model_dir}: model directory does not exist")
    cfg = config or load_model_config(model_dir)
    files = safetensors_files(model_dir)
    qconfig = checkpoint_quantization(model_dir)
    if qconfig is not None:
        check_scales(files, qconfig)  # before any weight is read
        state = _hf_state(cfg, files, fp8_tensors(files, qconfig))
        model = _assign(cfg, state, dtype, quantization or "fp8")
        jax.block_until_ready(nnx.state(model))
        return LoadedModel(model, cfg, "safetensors-fp8", time.perf_counter() - start)
    model, source, save_s = _load_full_precision(model_dir, cfg, files, dtype, use_cache)
    if quantization is not None:
        model = quantize_model(model, quantization)
        jax.block_until_ready(nnx.state(model))
    return LoadedModel(model, cfg, source, time.perf_counter() - start - save_s)


def _load_full_precision(model_dir: Path, cfg: ModelConfig, files: list[Path], dtype,
                         use_cache: bool) -> tuple[DecoderLM, str, float]:
    """The checkpoint in ``dtype``, from the Orbax cache when there is one (else read, then
    cached), and the seconds spent writing the cache (not loading time)."""
    cached = cache_root() / "orbax" / _cache_key(model_dir, files, dtype)
    if use_cache and cached.is_dir():
        return _restore_cached(cached, cfg, dtype), "orbax-cache", 0.0
    model = _assign(cfg, _hf_state(cfg, files), dtype)
    jax.block_until_ready(nnx.state(model))
    start = time.perf_counter()
    if use_cache:
        _save_cached(cached, model)
    return model, "safetensors", time.perf_counter() - start
