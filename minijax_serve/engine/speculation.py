"""Speculative decoding's set-up (docs/speculative.md): the draft model, loaded and checked
against the target, on a runner of its own whose pool has the target's pages; and the
:class:`~minijax_serve.speculative.speculator.Speculator` the scheduler asks for drafts."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from minijax_serve.attention.kv_cache import KVCache
from minijax_serve.attention.registry import attention_backend
from minijax_serve.config import EngineConfig
from minijax_serve.engine.model_source import ServedModel, served_model
from minijax_serve.executor.model_runner import ModelRunner
from minijax_serve.executor.tensor_parallel import layout as tp_layout, served_module
from minijax_serve.speculative.draft import DraftRunner, check_draft, first_layers
from minijax_serve.speculative.ngram import NgramProposer
from minijax_serve.speculative.simulated import SimulatedProposer
from minijax_serve.speculative.speculator import Speculator


def load_draft(config: EngineConfig, target: ServedModel, dtype, layer_loop: str,
               context_length: int) -> ServedModel | None:
    """The draft model of ``speculative_method="draft"`` (None otherwise): ``speculative_draft
    _model`` (by default the target's own module), checked against the target (vocabulary,
    context), cut to its first ``speculative_draft_layers`` layers if given."""
    if config.speculative_method != "draft":
        return None
    name = config.speculative_draft_model
    draft = target if name is None else served_model(name, config, dtype, layer_loop, None, None)
    check_draft(target.config, draft.config, target.tokenizer, draft.tokenizer, context_length)
    if config.speculative_draft_layers is not None:
        module = first_layers(draft.module, config.speculative_draft_layers)
        draft = draft._replace(module=module, config=module.cfg)
    return draft


def make_speculator(core: Any, draft: ServedModel | None, num_pages: int,
                    layer_loop: str) -> Speculator | None:
    """The Speculator of ``core``'s configuration (None when it does not speculate), wired
    into its scheduler; ValueError if ``num_speculative_tokens`` cannot fit the context."""
    config = core.config
    if config.speculative_method is None:
        return None
    k = config.num_speculative_tokens
    if k + 2 > core.context_length:
        raise ValueError(f"num_speculative_tokens={k}: a verify step of k + 1 tokens after a "
                         f"prompt token needs context_length >= {k + 2}, got "
                         f"{core.context_length}")
    proposer, runner = None, None
    if core.profile is not None:
        proposer = SimulatedProposer(core.runner, config.speculative_simulated_acceptance).propose
    elif config.speculative_method == "ngram":
        proposer = NgramProposer(config.speculative_ngram_min, config.speculative_ngram_max).propose
    else:
        tp = tp_layout(draft.config, config.tensor_parallel_size)
        module, cfg = served_module(draft.module, draft.config, tp)
        backend = attention_backend(config, cfg, core.platform, core.dtype)
        runner = DraftRunner(
            ModelRunner(module, cfg, num_pages=num_pages, page_size=config.page_size,
                        num_slots=config.max_running_requests,
                        kv=KVCache(jnp.dtype(core.dtype), None),  # the draft's own KV: plain
                        attention_backend=backend, layer_loop=layer_loop,
                        max_logprobs=config.max_logprobs, context_length=core.context_length,
                        tp=tp),
            core.buckets, core.slot_table, config.page_size)
    speculator = Speculator(k=k, max_running=config.max_running_requests, runner=core.runner,
                            table=core.slot_table, scratch_slot=core.slots.scratch_slot,
                            proposer=proposer, draft=runner)
    core.scheduler.propose = speculator.propose
    return speculator
