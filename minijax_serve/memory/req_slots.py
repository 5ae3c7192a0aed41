"""RequestSlots: the host ledger of request slots (rows of the device token buffer)."""

from __future__ import annotations


class RequestSlots:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def scratch_slot(self) -> int:
        """The extra token-buffer row that padding sequences write to."""
        return self.num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise RuntimeError("out of request slots")
        return self._free.pop()

    def free(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise RuntimeError(f"request slot {slot} freed twice or out of range")
        self._free.append(slot)

    def free_slot_ids(self) -> set[int]:
        return set(self._free)
