"""Weight loading: parsing safetensors versus restoring the Orbax load cache.

    python benchmarks/load_times.py [--model smollm2-135m]

Loads the model twice into an empty temporary cache directory: the first load parses the
safetensors and writes the Orbax checkpoint, the second restores it. Prints both times and
checks that the parameters are bitwise identical.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()
    from flax import nnx

    from minijax_serve.models.loader import load_model
    from minijax_serve.models.registry import resolve_model

    path = resolve_model(args.model).path  # converts the GGUF first if needed (not timed)
    with tempfile.TemporaryDirectory() as cache:
        os.environ["MINIJAX_SERVE_CACHE"] = cache
        first = load_model(path)
        second = load_model(path)
    leaves = [jax_leaves(nnx.state(m.model)) for m in (first, second)]
    identical = all(np.array_equal(a, b) for a, b in zip(*leaves))
    print(f"model: {args.model} ({first.config.num_params() / 1e6:.1f}M parameters, float32)")
    print(f"load 1 ({first.source}): {first.load_time_s:.2f} s")
    print(f"load 2 ({second.source}): {second.load_time_s:.2f} s")
    print(f"bitwise identical: {identical}")


def jax_leaves(state) -> list[np.ndarray]:
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(state)]


if __name__ == "__main__":
    main()
