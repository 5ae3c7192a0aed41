"""ModelSpec: what the engine needs of any model; ModelConfig: the built-in decoder family's
shape, read from a HuggingFace ``config.json``.

One frozen dataclass covers Llama, Mistral, Qwen2 and Qwen3. Anything the decoder cannot
reproduce exactly (an unknown architecture, a rotary scaling we do not implement) is rejected
here with an error that names the file; a sliding window caps the context the engine serves.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """What the engine needs to know of a model to serve it: the KV pool's shape per token,
    the vocabulary, the longest sequence, and the end-of-sequence tokens.

    Built for a model of your own (``Engine(model, model_config=ModelSpec(...))``); the
    built-in family's :class:`ModelConfig` is one."""

    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self):
        for name in ("vocab_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model_config.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model_config.num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if not all(isinstance(i, int) and i >= 0 for i in self.eos_token_ids):
            raise ValueError(f"model_config.eos_token_ids must be token ids, got "
                             f"{self.eos_token_ids!r}")

    def context_limit(self) -> tuple[int, str]:
        """The longest sequence the engine serves exactly, and what sets it (for errors)."""
        return self.max_position_embeddings, f"max_position_embeddings={self.max_position_embeddings}"

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """Bytes of K and V one token holds across every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig(ModelSpec):
    """The built-in decoder family's configuration (from a HuggingFace ``config.json``)."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None  # a window shorter than max_position_embeddings, if any

    def context_limit(self) -> tuple[int, str]:
        """A sliding window caps the context: the engine's attention does not slide, and within
        the window sliding-window attention is plain causal attention."""
        if self.sliding_window is None:
            return super().context_limit()
        return self.sliding_window, (f"sliding_window={self.sliding_window} (sliding-window "
                                     f"attention is not supported)")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_matrix_params(self) -> int:
        """One layer's linear-layer weights (q, k, v, o and the MLP's gate, up, down): what FP8
        quantizes, what a device splits with tensor parallelism."""
        h = self.hidden_size
        return 2 * h * self.q_size + 2 * h * self.kv_size + 3 * h * self.intermediate_size

    def num_params(self) -> int:
        """Parameter count (embeddings included once when tied)."""
        h, i, L = self.hidden_size, self.intermediate_size, self.num_layers
        attn = h * self.q_size * 2 + h * self.kv_size * 2
        attn += (self.q_size + 2 * self.kv_size) * self.qkv_bias + h * self.o_bias
        attn += 2 * self.head_dim * self.qk_norm
        mlp = 3 * h * i + (2 * i + h) * self.mlp_bias
        per_layer = attn + mlp + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return L * per_layer + emb + h

    def rope_inv_freq(self) -> np.ndarray:
        """Rotary inverse frequencies [head_dim/2] in float32, as HuggingFace computes them."""
        d = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))
        inv = inv.astype(np.float32)
        if self.rope_type == "linear":
            inv = inv / np.float32(self.rope_factor)
        elif self.rope_type == "llama3":
            low_wavelen = self.rope_original_max_positions / self.rope_low_freq_factor
            high_wavelen = self.rope_original_max_positions / self.rope_high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / self.rope_factor, inv)
            smooth = (self.rope_original_max_positions / wavelen - self.rope_low_freq_factor) / (
                self.rope_high_freq_factor - self.rope_low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / self.rope_factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            inv = np.where(medium, smoothed, scaled).astype(np.float32)
        return inv


_REQUIRED = object()


def _number(raw: dict[str, Any], source: str, name: str, kind: type = int,
            default: Any = _REQUIRED, minimum: float | None = None) -> Any:
    """config.json's field ``name`` as ``kind`` (int: an integral number; float: any finite
    number), ``default`` when it is absent or null; a ValueError naming the file and the field
    when it is missing, of another type or below ``minimum``."""
    value = raw.get(name)
    if value is None:
        if default is _REQUIRED:
            raise ValueError(f"{source}: field {name!r} is missing")
        return default
    number = isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)
    if not number or (kind is int and not float(value).is_integer()) or (
            minimum is not None and value < minimum):
        want = "an integer" if kind is int else "a number"
        bound = "" if minimum is None else f" >= {minimum:g}"
        raise ValueError(f"{source}: field {name!r} must be {want}{bound}, got {value!r}")
    return kind(value)


def _rope_fields(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """Read rotary settings as transformers does: the older ``rope_scaling`` before transformers
    5's ``rope_parameters``, a top-level ``original_max_position_embeddings`` first."""
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"{source}: per-layer-type rope_parameters are not supported")
    theta = _number(params if "rope_theta" in params else raw, source, "rope_theta", float,
                    10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{source}: rope type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})"
        )
    fields: dict[str, Any] = {"rope_theta": theta, "rope_type": rope_type}
    try:
        if rope_type in ("linear", "llama3"):
            fields["rope_factor"] = float(params["factor"])
        if rope_type == "llama3":
            fields["rope_low_freq_factor"] = float(params["low_freq_factor"])
            fields["rope_high_freq_factor"] = float(params["high_freq_factor"])
            fields["rope_original_max_positions"] = int(
                raw.get("original_max_position_embeddings")
                or params.get("original_max_position_embeddings")
                or raw["max_position_embeddings"])
    except KeyError as e:
        raise ValueError(f"{source}: {rope_type} rope scaling needs {e.args[0]}") from None
    return fields


def _sliding_window(raw: dict[str, Any], model_type: str, context: int, source: str
                    ) -> int | None:
    """The window of a model whose attention slides within its context, as transformers reads
    it: Mistral's ``sliding_window`` (4096 when absent); Qwen's (also 4096 when absent) only
    with ``use_sliding_window`` and where some layer slides (``layer_types``, else the layers
    from ``max_window_layers`` on)."""
    if model_type in ("qwen2", "qwen3"):
        slides = bool(raw.get("use_sliding_window", False)) and (
            "sliding_attention" in raw["layer_types"] if raw.get("layer_types")
            else _number(raw, source, "max_window_layers", default=28)
            < _number(raw, source, "num_hidden_layers"))
        if not slides:
            return None
    default = 4096 if model_type != "llama" else None
    # present but null: no window, as transformers reads it
    window = _number(raw, source, "sliding_window", int, None) if "sliding_window" in raw \
        else default
    return window if window is not None and window < context else None


def _as_tuple(ids: Any) -> tuple[int, ...]:
    if ids is None:
        return ()
    return tuple(int(i) for i in ids) if isinstance(ids, (list, tuple)) else (int(ids),)


def model_config_from_dict(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Build a ModelConfig from a HuggingFace config dictionary; ``source`` names it in errors."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        archs = raw.get("architectures")
        raise ValueError(
            f"{source}: architecture {model_type!r} ({archs}) is not supported "
            f"(supported model_type: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # one function under two names
        raise ValueError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
    def number(name: str, kind: type = int, default: Any = _REQUIRED) -> Any:
        return _number(raw, source, name, kind, default, 1 if kind is int else None)

    heads = number("num_attention_heads")
    hidden = number("hidden_size")
    context = number("max_position_embeddings", default=2048)
    attention_bias = bool(raw.get("attention_bias", False)) and model_type != "mistral"
    default_head_dim = 128 if model_type == "qwen3" else hidden // heads  # transformers' defaults
    return ModelConfig(
        model_type=model_type,
        vocab_size=number("vocab_size"),
        hidden_size=hidden,
        intermediate_size=number("intermediate_size"),
        num_layers=number("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=number("num_key_value_heads", default=heads),
        head_dim=number("head_dim", default=default_head_dim),
        rms_norm_eps=number("rms_norm_eps", float, 1e-6),
        max_position_embeddings=context,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=True if model_type == "qwen2" else attention_bias,
        o_bias=attention_bias if model_type in ("llama", "qwen3") else False,
        mlp_bias=bool(raw.get("mlp_bias", False)) if model_type == "llama" else False,
        qk_norm=model_type == "qwen3",
        sliding_window=_sliding_window(raw, model_type, context, source),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_as_tuple(raw.get("eos_token_id")),
        **_rope_fields(raw, source),
    )


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read ``model_dir/config.json``; ``generation_config.json``'s EOS ids, when it has them,
    replace config.json's (as transformers' ``generate`` uses them)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no config.json in the model directory")
    raw = _read_json(path, "the model config")
    try:
        cfg = model_config_from_dict(raw, str(path))
    except (TypeError, ValueError, KeyError, AttributeError) as e:  # a field the checks miss
        if str(e).startswith(str(path)):
            raise
        raise ValueError(f"{path}: a field has a bad value: {type(e).__name__}: {e}") from None
    gen_path = Path(model_dir) / "generation_config.json"
    if gen_path.is_file():
        try:
            eos = _as_tuple(_read_json(gen_path, "the generation config").get("eos_token_id"))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{gen_path}: field 'eos_token_id' must be token ids: {e}") from None
        if eos:
            cfg = dataclasses.replace(cfg, eos_token_ids=eos)
    return cfg


def _read_json(path: Path, what: str) -> dict[str, Any]:
    """A JSON object file; a ValueError naming it if it is not one."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read {what}: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: {what} must be a JSON object, got {type(raw).__name__}")
    return raw
