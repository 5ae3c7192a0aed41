"""Model aliases: short names for the default model and for dummy-weight model shapes."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from minijax_serve.models.loader import cache_root

_CONFIGS = Path(__file__).parent / "configs"


class ResolvedModel(NamedTuple):
    path: Path  # an HF-format directory (config.json, weights unless dummy, tokenizer)
    dummy: bool  # shape only: random weights, no tokenizer


def _smollm2() -> ResolvedModel:
    from minijax_serve.models.gguf_convert import ensure_smollm2

    return ResolvedModel(ensure_smollm2(cache_root()), dummy=False)


ALIASES = {
    "smollm2-135m": _smollm2,
    "qwen3-0.6b": lambda: ResolvedModel(_CONFIGS / "qwen3-0.6b", dummy=True),
    "llama-3-8b": lambda: ResolvedModel(_CONFIGS / "llama-3-8b", dummy=True),
}


def resolve_model(model: str | Path) -> ResolvedModel:
    """An alias from ``ALIASES`` or a path to an HF-format model directory."""
    if str(model) in ALIASES:
        return ALIASES[str(model)]()
    path = Path(model)
    if not path.is_dir():
        raise FileNotFoundError(
            f"{path}: model directory does not exist (and it is not an alias: {', '.join(ALIASES)})"
        )
    return ResolvedModel(path, dummy=False)
