"""How the server answers and what one client may ask of it (the engine's own configuration
is the EngineConfig): the API key, the origins allowed, and the bounds on one request's body
and work, the queue and the time of an engine step. No web framework is imported here: the
CLI reads it to build its flags."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path

MAX_REQUEST_BODY_BYTES = 8 * 2**20  # a request body's bytes: 413 past them
MAX_REQUEST_SEQUENCES = 256  # prompts x n of one request
MAX_REQUEST_TOKENS = 2**20  # prompt + max_tokens, over a request's sequences
WATCHDOG_TIMEOUT_S = 300.0  # SGLang's default
API_KEY_ENV = "MINIJAX_SERVE_API_KEY"  # as vLLM's VLLM_API_KEY (never OPENAI_API_KEY: a client's)


def resolve_api_key(flag: str | None, file: str | None, environ: Mapping[str, str] | None = None
                    ) -> str | None:
    """The API key: ``--api-key``, else the first line of ``--api-key-file``, else
    ``$MINIJAX_SERVE_API_KEY``, else None (no key). ValueError for an empty key or both flags;
    the key itself is never in a message."""
    environ = os.environ if environ is None else environ
    if flag is not None and file is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if flag is not None:
        key, source = flag, "--api-key"
    elif file is not None:
        try:
            lines = Path(file).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--api-key-file {file}: cannot read it: {e}") from None
        key, source = (lines[0].strip() if lines else ""), f"--api-key-file {file}"
    elif API_KEY_ENV in environ:
        key, source = environ[API_KEY_ENV], API_KEY_ENV
    else:
        return None
    if not key:
        raise ValueError(f"{source}: the API key is empty")
    return key


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """The server's settings; every bound is checked before anything is queued, and a request
    that alone passes one gets a 4xx naming it (never the 503 that tells a client to retry)."""

    served_model_name: str
    # every endpoint but /health then needs "Bearer <key>"; kept out of repr (and logs)
    api_key: str | None = dataclasses.field(default=None, repr=False)
    max_queued_requests: int | None = None  # sequences submitted and not running yet; 503 past it
    max_request_body_bytes: int = MAX_REQUEST_BODY_BYTES
    max_request_sequences: int = MAX_REQUEST_SEQUENCES
    max_request_tokens: int = MAX_REQUEST_TOKENS
    # browser origins allowed (CORS); "*" for any. None: cross-origin requests get a 403
    allowed_origins: tuple[str, ...] | None = None
    # an engine step running longer marks the server unhealthy and fails what is in flight
    watchdog_timeout: float | None = None
    enable_debug_endpoints: bool = False  # GET /debug/engine: the engine's state, checked
    update_weights_dir: str | None = None  # POST /update_weights_from_disk reads under it only

    def __post_init__(self) -> None:
        for name in ("max_request_body_bytes", "max_request_sequences", "max_request_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        if self.watchdog_timeout is not None and not self.watchdog_timeout > 0:
            raise ValueError(f"watchdog_timeout must be > 0, got {self.watchdog_timeout}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
