"""minijax_serve: a JAX/Pallas LLM serving engine in the lineage of SGLang."""

from minijax_serve.config import EngineConfig
from minijax_serve.engine import Engine
from minijax_serve.request import RequestOutput
from minijax_serve.sampling_params import SamplingParams

__all__ = ["Engine", "EngineConfig", "RequestOutput", "SamplingParams"]
