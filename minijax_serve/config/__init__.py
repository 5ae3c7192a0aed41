"""Configuration: :class:`EngineConfig`, the names of its choices, and the command-line flags built
from it. Imports nothing of the scheduler, the executor or the kernels."""

from minijax_serve.config.engine_config import EngineConfig

__all__ = ["EngineConfig"]
