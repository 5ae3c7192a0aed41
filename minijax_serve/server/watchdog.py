"""The watchdog (SGLang's ``--watchdog-timeout``): an engine step that does not return within
the timeout means the device or the engine hangs, and a server that would wait for it forever
is worse than one that goes.

A thread reads the engine loop's :attr:`~minijax_serve.server.engine_loop.EngineLoop.busy_since`
(set while it runs a step or a command; not while the model loads and warms up). Past the
timeout it marks the server unhealthy (``/health`` answers 503), fails every request in flight
with an error naming the timeout (:meth:`EngineLoop.declare_hung`) and calls ``on_hang``, with
which ``serve`` stops and exits non-zero so that a supervisor restarts it. Without ``--warmup``
a step's first run of a shape compiles it: the timeout must cover that too.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from minijax_serve.server.engine_loop import EngineLoop

log = logging.getLogger("minijax_serve.server")


class Watchdog:
    """Watches ``loop`` from its own thread until :meth:`stop` (or until it fires, once)."""

    def __init__(self, loop: EngineLoop, timeout_s: float,
                 on_hang: Callable[[str], None] | None = None):
        self._loop, self.timeout_s, self._on_hang = loop, timeout_s, on_hang
        self._period = min(1.0, timeout_s / 4)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.wait(self._period):
            since = self._loop.busy_since
            if since is not None and time.monotonic() - since > self.timeout_s:
                message = (f"watchdog: an engine step did not return within "
                           f"{self.timeout_s:g} s (--watchdog-timeout); the server is unhealthy "
                           f"and stops")
                log.error(message)
                self._loop.declare_hung(message)
                if self._on_hang is not None:
                    self._on_hang(message)
                return
