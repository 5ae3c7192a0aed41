"""Many processes (``jax.distributed``): JAX's multi-controller model.

Every process builds the same engine and calls the same methods with the same arguments; the
scheduler is deterministic, so each lowers the same batch and the devices of all of them run
one program. What the host hands the devices becomes a global array (:func:`to_global`), what
it reads back is its own copy of a replicated result (:func:`to_local`). :func:`agree` checks
that the processes agree (on every submitted request, and now and then on the lowered batch)
and raises a clear error on all of them when they do not, instead of letting them diverge
into collectives that never match.
"""

from __future__ import annotations

import hashlib

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Sharding


def multi_process() -> bool:
    return jax.process_count() > 1


def to_global(x, sharding: Sharding) -> jax.Array:
    """``x`` (the same host or local values on every process) as a global array of ``sharding``."""
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def place(x, sharding: Sharding) -> jax.Array:
    """``x`` placed by ``sharding``: moved on the devices, or through the host when the
    sharding spans processes."""
    return to_global(x, sharding) if multi_process() else jax.device_put(x, sharding)


def to_local(x: jax.Array) -> jax.Array:
    """This process's copy of a replicated global array (itself when fully addressable)."""
    return x if x.is_fully_addressable else x.addressable_data(0)


def agree(what: str, payload: bytes) -> None:
    """Raise ValueError on every process unless all of them pass the same ``payload`` (a
    collective: every process must call it at the same point)."""
    if not multi_process():
        return
    digest = np.frombuffer(hashlib.sha256(payload).digest(), np.uint32).astype(np.int32)
    try:
        multihost_utils.assert_equal(digest, f"{what} differs between processes")
    except AssertionError as err:
        raise ValueError(f"the {jax.process_count()} processes disagree on {what} (process "
                         f"{jax.process_index()}): every process must construct the same Engine "
                         "and call it with the same arguments") from err
