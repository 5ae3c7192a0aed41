"""The ``minijax-serve`` command (``generate``, ``serve``, ``bench``)."""

from minijax_serve.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
