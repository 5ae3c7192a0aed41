"""SGLang's ``POST /update_weights_from_disk``: serve the weights of another model directory of
the same architecture (docs/rl.md, "Over HTTP").

A client must not make the server read any file it names: the endpoint exists only when the
operator starts the server with ``--update-weights-dir DIR``, and it reads only a model
directory under ``DIR``, after resolving the path (``..``, symbolic links): a path leading out
of ``DIR``, or a directory with a file (a link) or a shard index entry leading out of it, is
refused with a 400 before any of them is read. The weights are loaded on a worker
thread, then handed to the engine's thread with ``in_flight="finish"``: requests in flight
finish on the old weights first, streaming as usual, while new ones wait; the answer comes once
the new weights are served.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from flax import nnx

from minijax_serve.models.loader import load_model, safetensors_files
from minijax_serve.server.answer import unavailable
from minijax_serve.server.protocol import APIError, bad

FIELD = "model_path"
POLL_S = 0.02  # how often the handler asks whether a pending update is done


def model_dir_under(root: Path, given: Any) -> Path:
    """The model directory ``given`` names (relative to ``root``, or absolute), resolved;
    ValueError unless it, every file in it and every weight file its shard index names lie
    under ``root`` (checked before any of them is read)."""
    if not isinstance(given, str) or not given:
        raise ValueError(f"{FIELD} must be a non-empty string (a model directory under the "
                         "server's --update-weights-dir)")
    root = root.resolve()
    path = (root / given).resolve()
    if not path.is_relative_to(root):
        raise ValueError(f"{FIELD} {given!r} leads out of the server's --update-weights-dir")
    if not path.is_dir():
        raise ValueError(f"{FIELD} {given!r}: no such model directory under the server's "
                         "--update-weights-dir")
    outside = "the server's --update-weights-dir"
    for f in path.iterdir():  # config.json, generation_config.json, the index...: links too
        if not f.resolve().is_relative_to(root):
            raise ValueError(f"{FIELD} {given!r}: {f.name} leads out of {outside}")
    try:  # the files a shard index names, checked before they are looked at
        safetensors_files(path, within=root)
    except (FileNotFoundError, ValueError) as e:
        message = str(e).replace(str(path), "the directory").replace(str(root), outside)
        raise ValueError(f"{FIELD} {given!r}: {message}") from None
    return path


def add_update_weights(app: FastAPI, engine_loop: Callable[[], Any], json_body: Callable,
                       weights_dir: str) -> None:
    """Register ``POST /update_weights_from_disk`` on ``app`` over the engine loop that
    ``engine_loop()`` returns (``json_body(request)``: the request's parsed JSON body)."""
    root = Path(weights_dir)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        body, loop = await json_body(request), engine_loop()
        try:
            path = model_dir_under(root, body.get(FIELD) if isinstance(body, dict) else None)
            loaded = await asyncio.to_thread(
                load_model, path, dtype=loop.engine.dtype, load_format="safetensors",
                use_cache=False, quantization=loop.engine.config.quantization)
            version = await asyncio.wrap_future(loop.call(
                lambda engine: engine.update_weights(nnx.state(loaded.model), wait=False)))
            while await asyncio.wrap_future(loop.call(lambda e: e.weights_update_pending)):
                await asyncio.sleep(POLL_S)
        except (ValueError, FileNotFoundError, RuntimeError) as e:
            if loop.hung is not None:
                raise unavailable(loop) from None
            if isinstance(e, jax.errors.JaxRuntimeError):  # the device's, not the client's
                raise
            message = str(e).replace(str(root.resolve()), "DIR")  # no server paths
            message = message if message.startswith(FIELD) else f"{FIELD}: {message}"
            if isinstance(e, RuntimeError):  # an update pending, the engine asleep: try later
                raise APIError(409, message, FIELD, code="conflict") from None
            raise bad(message, FIELD) from None
        return JSONResponse({"success": True, "weights_version": version,
                             "message": f"serving the weights of {body[FIELD]!r} "
                                        f"(weights_version {version})"})
