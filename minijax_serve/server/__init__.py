"""The OpenAI-compatible HTTP server (the ``[serve]`` extra): ``minijax-serve serve``."""
