"""Host ledgers of device memory: KV pages and request slots."""

from minijax_serve.memory.page_allocator import PageAllocator
from minijax_serve.memory.req_slots import RequestSlots

__all__ = ["PageAllocator", "RequestSlots"]
