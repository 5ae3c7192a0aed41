"""Host ledgers of device memory: KV pages, request slots and the prefix cache over the pages."""

from minijax_serve.memory.page_allocator import PageAllocator
from minijax_serve.memory.prefix_cache import NoPrefixCache, PrefixCache, PrefixMatch
from minijax_serve.memory.radix_cache import RadixCache
from minijax_serve.memory.req_slots import RequestSlots
from minijax_serve.memory.slot_table import SlotTable

__all__ = ["NoPrefixCache", "PageAllocator", "PrefixCache", "PrefixMatch", "RadixCache", "RequestSlots",
           "SlotTable"]
