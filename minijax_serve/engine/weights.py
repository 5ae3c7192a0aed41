"""Weights in place: a trainer in the same process updates the served weights, borrows the KV
pool's memory for its own step, and trains the served model itself (docs/rl.md).

The engine is driven by one thread, so every call here happens between two steps: at a step
boundary. An update swaps the runner's weight arrays for new ones of the same names, shapes,
dtypes and shardings, so the compiled programs run them as they are (nothing recompiles); the
prefix cache is flushed (its KV came from the old weights); every output says which weights
its tokens came from (``RequestOutput.weights_version``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flax import nnx

from minijax_serve.executor.weight_update import (PoolSpec, WeightLayout, release_pools,
                                                  restore_pools)
from minijax_serve.models.decoder import DecoderLM
from minijax_serve.models.loader import load_model

IN_FLIGHT = ("finish", "recompute")  # what an update does to the requests it finds running


class InPlaceWeights:
    """``update_weights``, ``sleep`` / ``wake_up`` and ``model``, mixed into
    :class:`~minijax_serve.Engine` (over :class:`~minijax_serve.engine.core.EngineCore`)."""

    def __init__(self, *args: Any):
        super().__init__(*args)
        self.weights_version = 0  # 0: the weights the engine was built with; +1 per update
        self._layout: WeightLayout | None = None
        self._released: PoolSpec | None = None  # the KV pools while asleep
        self._update: list | None = None  # placed weights waiting for started requests

    # -- updates ----------------------------------------------------------------------------

    def update_weights(self, params: Any, in_flight: str = "finish", wait: bool = True) -> int:
        """Serve ``params`` from now on; returns the new ``weights_version``.

        ``params``: the served model's weights, all of them, as ``nnx.state(engine.model)``
        has them (an NNX state or module, a nested dict of arrays, or a flat ``{name: array}``
        dict with the load cache's names: ``"embed_tokens"``, ``"layers.0.wq"``, ...), of the
        same shapes and dtypes. They are checked (ValueError naming the first weight missing,
        unexpected or of another shape or dtype), then placed on the engine's mesh by its
        sharding (arrays placed so already, e.g. a trainer's outputs from ``engine.model``,
        are taken as they are: no copy), before anything changes.

        ``in_flight``: what happens to requests already started (admitted, or with tokens):
        ``"finish"`` runs them to their end on the old weights first, admitting no new request
        meanwhile (the engine steps here until they are done, their outputs waiting for
        ``step()``; with ``wait=False`` the call returns at once and a later ``step()`` swaps
        the weights once they are done: ``weights_update_pending`` until then);
        ``"recompute"`` sends them back to the queue at once: their KV (prompt and tokens so
        far) is computed again on the new weights, which make their later tokens
        (``RequestOutput.token_weights_versions`` tells which). Requests not started yet run
        on the new weights either way. The prefix cache is flushed. RuntimeError while asleep
        (``wake_up(params)`` updates and wakes) or while another update is pending."""
        self._check_no_draft("update_weights")
        self._check_awake("update_weights")
        if in_flight not in IN_FLIGHT:
            raise ValueError(f"in_flight must be one of {', '.join(IN_FLIGHT)}, got {in_flight!r}")
        if self._update is not None:
            raise RuntimeError("update_weights: an update is pending (it waits for the requests "
                               "in flight to finish)")
        leaves = self._new_weights(params)
        if in_flight == "recompute":
            self._recompute_started()
            self._swap(leaves)
            return self.weights_version
        self._update = leaves
        self._swap_when_done()
        while wait and self._update is not None:
            self._tick()
        return self.weights_version + (self._update is not None)

    @property
    def weights_update_pending(self) -> bool:
        """An ``update_weights(..., wait=False)`` waits for the requests it found started."""
        return self._update is not None

    def update_weights_from_disk(self, model_path: str | Path, in_flight: str = "finish") -> int:
        """``update_weights`` with the safetensors weights of an HF-format model directory of
        the same architecture (the built-in decoder family only); returns the new version."""
        self._check_awake("update_weights_from_disk")
        if not isinstance(self._weights_layout().runner_module(), DecoderLM):
            raise ValueError("model_path: only the built-in decoder family loads weights from "
                             "a model directory; pass your own model's weights to "
                             "update_weights")
        loaded = load_model(model_path, dtype=self.dtype, load_format="safetensors",
                            use_cache=False, quantization=self.config.quantization)
        return self.update_weights(nnx.state(loaded.model), in_flight)

    def _weights_layout(self) -> WeightLayout:
        if self.config.simulate is not None:
            raise ValueError("a simulated engine runs no model: it has no weights")
        if self._layout is None:
            self._layout = WeightLayout(self.runner, self.model_config, self.tp.kv_replicas)
        return self._layout

    def _new_weights(self, params: Any) -> list:
        layout = self._weights_layout()
        return layout.placed(layout.check(params))

    def _tick(self) -> list:
        """A tick; with an update pending, one that admits no request not started yet, and
        the update swapped in once no started request is left."""
        if self._update is None:
            return super()._tick()
        sched = self.scheduler
        parked = [r for r in sched.waiting if not r.output_ids]
        sched.waiting = [r for r in sched.waiting if r.output_ids]  # retracted: started
        try:
            return super()._tick()
        finally:
            sched.waiting += parked
            self._swap_when_done()

    def has_unfinished(self) -> bool:
        """Requests are in flight, or an update waits for those it found started."""
        return super().has_unfinished() or self._update is not None

    def _swap_when_done(self) -> None:
        """Swap the pending weights in if no started request is left."""
        sched = self.scheduler
        if not (sched.holders() or self._in_flight is not None
                or any(r.output_ids for r in sched.waiting)):
            leaves, self._update = self._update, None
            self._swap(leaves)

    def _recompute_started(self) -> None:
        """Take the step in flight, then send every request holding KV back to the queue, in
        order (its KV is computed again when it is admitted)."""
        if self._in_flight is not None:
            done, self._in_flight = self._in_flight, None
            self._router.mark(self._process(*done)[0])
        for req in reversed(self.scheduler.holders()):
            self.scheduler.retract(req)

    def _swap(self, leaves: list) -> None:
        assert not self.scheduler.holders(), "weights swapped under running requests"
        self.runner.params = leaves
        self.prefix_cache.reset()
        self.weights_version += 1
        for req in self.scheduler.waiting:
            req.weights_changed(self.weights_version)

    # -- memory for a trainer ----------------------------------------------------------------

    @property
    def is_sleeping(self) -> bool:
        """``sleep()`` released the KV pools and ``wake_up()`` has not restored them yet."""
        return self._released is not None

    def sleep(self, release_weights: bool = False) -> None:
        """Release the KV pools' device memory (the prefix cache is flushed), e.g. for a
        training step; with ``release_weights`` drop the engine's references to its weights
        too (their memory is freed unless someone else holds them, e.g. a trainer's model
        from ``engine.model``). ``wake_up`` restores both. RuntimeError while requests are
        waiting or running, or when asleep already; adding requests while asleep raises too."""
        self._check_no_draft("sleep")
        self._check_awake("sleep")
        sched = self.scheduler
        if sched.has_unfinished() or self._in_flight is not None or self._update is not None:
            raise RuntimeError(f"cannot sleep while requests are in flight ({len(sched.waiting)} "
                               f"waiting, {len(sched.holders())} running): let them finish or "
                               "abort them first")
        self._weights_layout()  # kept: the shardings new weights are placed by
        sched.flush_cache()
        self._released = release_pools(self.runner)
        if release_weights:
            self.runner.params = None

    def wake_up(self, params: Any = None) -> int:
        """Rebuild the KV pools as they were (same shapes and shardings: the same programs,
        nothing recompiles); with ``params``, serve them from now on (checked as by
        ``update_weights``, before anything changes), which is required after
        ``sleep(release_weights=True)``. Returns the weights version."""
        if self._released is None:
            raise RuntimeError("wake_up: the engine is awake (sleep() releases its memory)")
        if params is None and self.runner.params is None:
            raise ValueError("params: sleep(release_weights=True) released the weights; pass "
                             "the weights to serve: wake_up(params)")
        leaves = None if params is None else self._new_weights(params)
        restore_pools(self.runner, self._released)
        self._released = None
        if leaves is not None:
            self._swap(leaves)
        return self.weights_version

    def _check_no_draft(self, what: str) -> None:
        if self.config.speculative_method == "draft":  # its runner holds weights and a pool
            raise ValueError(f"{what} with speculative_method='draft' is not supported (the "
                             "draft model's weights and KV pool would stay as they were); use "
                             "speculative_method='ngram' or none")

    def _check_awake(self, what: str) -> None:
        if self._released is not None:
            raise RuntimeError(f"{what}: the engine is asleep (sleep()); wake_up() first, or "
                               "wake_up(params) to wake on new weights")

    # -- the model for training ---------------------------------------------------------------

    @property
    def model(self) -> nnx.Module:
        """The served model as a plain NNX module over the engine's current weight arrays
        (the same arrays, not copies, unless tensor parallelism padded the vocabulary or
        replicated KV heads: then a copy in the served shapes). Train it like any NNX module
        (its full-sequence forward: :func:`minijax_serve.models.training.token_logprobs`, or
        :func:`~minijax_serve.dense_forward`) and serve the result with
        ``update_weights(nnx.state(model))``; the engine's own arrays never change in place."""
        if self.runner.params is None:
            raise RuntimeError("model: sleep(release_weights=True) released the weights")
        layout = self._weights_layout()
        return layout.served(layout.runner_module())

