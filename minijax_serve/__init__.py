"""minijax_serve: a JAX/Pallas LLM serving engine in the lineage of SGLang."""

from minijax_serve.attention.layer import DenseAttention, PagedAttention
from minijax_serve.config import EngineConfig
from minijax_serve.core.request import RequestOutput
from minijax_serve.core.sampling_params import SamplingParams
from minijax_serve.engine import Engine
from minijax_serve.models.config import ModelSpec
from minijax_serve.models.model_check import ModelProtocolError
from minijax_serve.models.protocol import DecoderModel, dense_forward, dense_greedy

__all__ = ["DecoderModel", "DenseAttention", "Engine", "EngineConfig", "ModelProtocolError",
           "ModelSpec", "PagedAttention", "RequestOutput", "SamplingParams", "dense_forward",
           "dense_greedy"]
