"""Per-sequence state slots for the layers that keep a state instead of KV (Qwen3.5's and
Qwen3-Next's linear attention, engine/models/layers/gated_delta.py).

A running sequence holds one slot, an index into every such layer's state tensors. It
takes it when first given tokens and gives it back when it finishes or is preempted (it
is then recomputed from position 0, which the layer starts from zeros). A fork (n > 1, a
beam) takes a slot of its own and a copy of its parent's state, made before the next
forward pass, in the order the forks happened.
"""

from __future__ import annotations


class StateSlots:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._held: dict[int, int] = {}
        self._copies: list[tuple[int, int]] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_hold(self, seq_id: int) -> bool:
        return seq_id in self._held or bool(self._free)

    def take(self, seq_id: int) -> int:
        """The sequence's slot, taken if it has none (can_hold said there is one)."""
        slot = self._held.get(seq_id)
        if slot is None:
            slot = self._held[seq_id] = self._free.pop()
        return slot

    def slot(self, seq_id: int) -> int:
        return self._held[seq_id]

    def fork(self, parent_id: int, child_id: int) -> None:
        """A slot for the child holding the parent's state; none while a preempted parent
        waits (the child is recomputed too, and takes one then). Forks happen within the
        running cap the slots are counted for, so one is free."""
        parent = self._held.get(parent_id)
        if parent is None:
            return
        if not self._free:
            raise RuntimeError("no state slot is free for a forked sequence")
        self._copies.append((parent, self.take(child_id)))

    def release(self, seq_id: int) -> None:
        slot = self._held.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self._copies = self._copies, []
        return copies
