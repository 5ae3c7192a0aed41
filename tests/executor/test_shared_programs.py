"""Engines of one configuration share their compiled programs in a process: a second engine
traces, lowers and compiles nothing (JAX's in-memory caches serve the first one's programs,
``minijax_serve.executor.step_functions.jitted``) and gives the same tokens; another
configuration compiles its own."""

from __future__ import annotations

import jax

from minijax_serve import Engine, SamplingParams
from tests.engine.test_engine import assert_idle_and_clean

CONFIG = dict(skip_tokenizer_init=True, max_total_tokens=512, max_running_requests=4,
              min_token_bucket=16, min_seq_bucket=4, min_kv_bucket=64, context_length=64)
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13]]


def compiles(make_engine) -> tuple[list, list[list[int]]]:
    """The XLA compilations (or persistent-cache reads) while an engine is made and serves
    PROMPTS, and its tokens."""
    events: list[str] = []

    def listen(event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        engine = make_engine()
        outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, ignore_eos=True))
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert_idle_and_clean(engine)
    return events, [o.token_ids for o in outs]


def test_a_second_engine_of_one_configuration_compiles_nothing(tiny_dir):
    _, first = compiles(lambda: Engine(tiny_dir["llama"], **CONFIG))
    events, second = compiles(lambda: Engine(tiny_dir["llama"], **CONFIG))
    assert events == [] and second == first
    events, other = compiles(lambda: Engine(tiny_dir["llama"], **dict(CONFIG, page_size=8)))
    assert events and other == first  # another page size: programs of its own, same tokens
