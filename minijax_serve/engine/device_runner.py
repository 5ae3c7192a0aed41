"""The runner of an engine on its devices: the mesh, the weights placed on it, the KV pools,
and the limits sized from the devices' memory."""

from __future__ import annotations

from typing import NamedTuple

from minijax_serve.config import EngineConfig
from minijax_serve.engine.kv_setup import kv_cache
from minijax_serve.engine.limits import Limits
from minijax_serve.engine.model_source import ServedModel
from minijax_serve.engine.setup import device_limits
from minijax_serve.executor.model_runner import ModelRunner
from minijax_serve.executor.tensor_parallel import TPLayout, layout as tp_layout, served_module
from minijax_serve.speculative.draft import pool_share


class DeviceRunner(NamedTuple):
    runner: ModelRunner
    tp: TPLayout  # the mesh (of one device at tensor_parallel_size 1)
    limits: Limits


def build_device_runner(config: EngineConfig, served: ServedModel, dtype, attention_backend: str,
                        layer_loop: str, context_length: int,
                        draft: ServedModel | None = None) -> DeviceRunner:
    """``served`` on ``config``'s mesh with pools sized from the devices' memory (a draft
    model's KV, when speculating with one, shares each page's memory)."""
    tp = tp_layout(served.config, config.tensor_parallel_size)
    kv = kv_cache(config, served.module, served.config, dtype, tp.kv_replicas)
    module, runner_cfg = served_module(served.module, served.config, tp)
    ps = config.page_size
    limits = device_limits(config, runner_cfg, kv.dtype, context_length,
                           config.tensor_parallel_size)
    if draft is not None and not config.max_total_tokens:
        share = pool_share(runner_cfg, draft.config)
        limits = limits._replace(pool_tokens=max(ps, int(limits.pool_tokens * share)))
    runner = ModelRunner(module, runner_cfg, num_pages=limits.pool_tokens // ps + 1,
                         page_size=ps, num_slots=limits.max_running_requests, kv=kv,
                         attention_backend=attention_backend, layer_loop=layer_loop,
                         max_logprobs=config.max_logprobs, context_length=context_length, tp=tp)
    return DeviceRunner(runner, tp, limits)
