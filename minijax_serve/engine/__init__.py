"""The engine: the public :class:`Engine` over its core (the tick), its setup (device, pool sizing,
model source), stats, step trace and compilation cache."""

from minijax_serve.engine.engine import Engine

__all__ = ["Engine"]
