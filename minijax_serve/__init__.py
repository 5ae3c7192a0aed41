"""minijax_serve: a JAX/Pallas LLM serving engine in the lineage of SGLang.

The public names below are imported on first use (PEP 562), so that what needs only some of
them (the configuration types, a client building ``SamplingParams``) does not pay for importing
the engine, Flax and JAX."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {  # public name -> the module that defines it
    "DecoderModel": "minijax_serve.models.protocol",
    "DenseAttention": "minijax_serve.attention.layer",
    "Engine": "minijax_serve.engine",
    "EngineConfig": "minijax_serve.config",
    "ModelProtocolError": "minijax_serve.models.model_check",
    "ModelSpec": "minijax_serve.models.config",
    "PagedAttention": "minijax_serve.attention.layer",
    "RequestOutput": "minijax_serve.core.request",
    "SamplingParams": "minijax_serve.core.sampling_params",
    "dense_forward": "minijax_serve.models.protocol",
    "dense_greedy": "minijax_serve.models.protocol",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from minijax_serve.attention.layer import DenseAttention, PagedAttention
    from minijax_serve.config import EngineConfig
    from minijax_serve.core.request import RequestOutput
    from minijax_serve.core.sampling_params import SamplingParams
    from minijax_serve.engine import Engine
    from minijax_serve.models.config import ModelSpec
    from minijax_serve.models.model_check import ModelProtocolError
    from minijax_serve.models.protocol import DecoderModel, dense_forward, dense_greedy


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:  # a subpackage, as ``minijax_serve.engine`` after ``import minijax_serve``
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value  # later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
