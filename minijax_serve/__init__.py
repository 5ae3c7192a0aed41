"""minijax_serve: a JAX/Pallas LLM serving engine in the lineage of SGLang."""

from minijax_serve.config import EngineConfig
from minijax_serve.engine import Engine
from minijax_serve.models.attention import DenseAttention, PagedAttention
from minijax_serve.models.config import ModelSpec
from minijax_serve.models.model_check import ModelProtocolError
from minijax_serve.models.protocol import DecoderModel, dense_forward, dense_greedy
from minijax_serve.request import RequestOutput
from minijax_serve.sampling_params import SamplingParams

__all__ = ["DecoderModel", "DenseAttention", "Engine", "EngineConfig", "ModelProtocolError",
           "ModelSpec", "PagedAttention", "RequestOutput", "SamplingParams", "dense_forward",
           "dense_greedy"]
