"""``GET /debug/engine`` (``serve --enable-debug-endpoints``; off by default): the engine's
state, read on its loop's thread, for a soak or an operator to see that nothing leaked."""

from __future__ import annotations

from typing import Any


def engine_report(engine: Any) -> dict[str, Any]:
    """The engine's queues, pages and slots, whether it is idle and clean (every KV page free
    or an evictable prefix-cache page, no cache lock held, every slot free, nothing
    unfinished) and its invariants (``"ok"`` or the violation)."""
    try:
        engine.check_invariants()
        invariants = "ok"
    except AssertionError as e:
        invariants = f"violated: {e}"
    allocator, cache, slots = engine.allocator, engine.prefix_cache, engine.slots
    cached_pages = cache.evictable_size // allocator.page_size
    unfinished = engine.has_unfinished()
    return {
        "running": len(engine.scheduler.holders()), "waiting": len(engine.scheduler.waiting),
        "unfinished": unfinished, "kv_tokens_used": engine.kv_tokens_used,
        "total_pages": allocator.total_pages, "free_pages": allocator.num_free,
        "prefix_cache_pages": cached_pages, "prefix_cache_locked_tokens": cache.protected_size,
        "num_slots": slots.num_slots, "free_slots": slots.num_free, "invariants": invariants,
        "idle": (not unfinished and cache.protected_size == 0
                 and allocator.num_free + cached_pages == allocator.total_pages
                 and slots.num_free == slots.num_slots)}
