"""The engine's one clock: every time it stamps (arrivals, token times, finishes, tick times)
comes from it, so a simulated engine measures everything in the simulated device's time.

:class:`WallClock` is ``time.perf_counter``; waiting for the device is real waiting.
:class:`VirtualClock` runs with the wall clock while the host works, so the host's time is the
real, measured time of the real scheduler code, and jumps ahead when the host would wait for the
simulated device (``wait_until``) or sleep (``sleep``), instead of waiting.
"""

from __future__ import annotations

import time


class WallClock:
    """``time.perf_counter``; ``wait_until`` returns at once (a real device is waited for by
    reading its results), ``sleep`` sleeps."""

    def now(self) -> float:
        """Seconds, ``time.perf_counter``."""
        return time.perf_counter()

    def wait_until(self, when: float) -> None:
        """Nothing: a real device's results are waited for when they are read."""

    def sleep(self, seconds: float) -> None:
        """``time.sleep``."""
        time.sleep(seconds)


class VirtualClock:
    """Wall time plus the waits it skipped: ``now()`` advances with ``time.perf_counter`` while
    the host works; ``wait_until(t)`` and ``sleep(s)`` move it ahead at once. With
    ``follow_wall=False`` the host's work takes no time: the clock moves only by ``wait_until``
    and ``sleep`` (a simulation's modeled costs), the same on every run."""

    def __init__(self, follow_wall: bool = True) -> None:
        self.skipped_s = 0.0  # total time jumped over: the simulated waits
        self.follow_wall = follow_wall

    def now(self) -> float:
        """Seconds: ``time.perf_counter`` (when following the wall clock) plus every wait
        skipped so far."""
        return (time.perf_counter() if self.follow_wall else 0.0) + self.skipped_s

    def wait_until(self, when: float) -> None:
        """Jump to ``when`` if it is still ahead (the host blocks on the device until then)."""
        ahead = when - self.now()
        if ahead > 0:
            self.skipped_s += ahead

    def sleep(self, seconds: float) -> None:
        """Jump ``seconds`` ahead: the host busy (a simulated dispatch) or idle."""
        if seconds > 0:
            self.skipped_s += seconds
