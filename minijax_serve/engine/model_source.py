"""What an engine serves: a model by name or directory (the built-in family, loaded with its
tokenizer), or a model object of one's own (the protocol of
:mod:`minijax_serve.models.protocol`, checked before anything is compiled)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, NamedTuple, Union

from flax import nnx

from minijax_serve.config import EngineConfig
from minijax_serve.engine.setup import load_tokenizer
from minijax_serve.executor.processes import multi_process
from minijax_serve.models.config import ModelSpec
from minijax_serve.models.loader import load_model
from minijax_serve.models.model_check import check_model
from minijax_serve.models.protocol import DecoderModel
from minijax_serve.models.quantize import quantize_model
from minijax_serve.models.registry import ResolvedModel, resolve_model

ModelArg = Union[str, Path, DecoderModel, Callable[[], DecoderModel]]


class ServedModel(NamedTuple):
    module: DecoderModel
    config: ModelSpec
    tokenizer: Any  # a HuggingFace tokenizer, or None: token ids in and out
    load_time_s: float


def served_model(model: ModelArg, config: EngineConfig, dtype, layer_loop: str,
                 model_config: ModelSpec | None, tokenizer: Any) -> ServedModel:
    """Load ``model`` (an alias or an HF-format directory), or check a model object (or call
    a zero-argument factory of one) against ``model_config``."""
    if isinstance(model, (str, Path)):
        if model_config is not None:
            raise ValueError("model_config= goes with a model object; a model name or "
                             f"directory ({model!r}) brings its own")
        resolved = resolve_model(model)
        loaded = load_model(resolved.path, dtype=dtype,
                            load_format="dummy" if resolved.dummy else config.load_format,
                            seed=config.seed, quantization=config.quantization,
                            use_cache=not multi_process())  # Orbax would coordinate the hosts
        return ServedModel(loaded.model, loaded.config,
                           model_tokenizer(resolved, config, loaded.config, tokenizer),
                           loaded.load_time_s)
    start = time.perf_counter()
    if callable(model) and not isinstance(model, nnx.Module):
        model = model()
    if not isinstance(model_config, ModelSpec):
        raise ValueError("model_config: a model object needs a ModelSpec (or ModelConfig) that "
                         f"describes it, got {type(model_config).__name__}")
    if config.quantization is not None:  # a copy: the caller's model is left as it was
        model = quantize_model(model, config.quantization, copy=True)
    check_model(model, model_config, layer_loop, dtype)
    tokenizer = checked_tokenizer(tokenizer, model_config, config)
    return ServedModel(model, model_config, tokenizer, time.perf_counter() - start)


def checked_tokenizer(tokenizer: Any, spec: ModelSpec, config: EngineConfig) -> Any:
    """``tokenizer`` if it fits the model's vocabulary; None with ``skip_tokenizer_init``."""
    if tokenizer is not None and len(tokenizer) > spec.vocab_size:
        raise ValueError(f"tokenizer: {len(tokenizer)} tokens, more than model_config.vocab_size"
                         f"={spec.vocab_size}")
    return None if config.skip_tokenizer_init else tokenizer


def model_tokenizer(resolved: ResolvedModel, config: EngineConfig, spec: ModelSpec,
                    tokenizer: Any = None) -> Any:
    """The tokenizer of a named model: ``tokenizer`` if one is given (borrowed, e.g. for a
    shape-only alias), else the model directory's own (none for a shape-only alias)."""
    if tokenizer is None and not (config.skip_tokenizer_init or resolved.dummy):
        tokenizer = load_tokenizer(resolved.path)
    return checked_tokenizer(tokenizer, spec, config)
