"""When each sandbox of a node is next due a look from the TTL loop, kept in a heap.

A node holds 10,000 idle sandboxes; a loop that scanned them all twice a second cost time on every tick for
every one of them. Here a tick costs O(log n) per entry that comes due. An entry is a hint, never the truth:
whatever changes a sandbox's deadline (create, suspend, resume, set_timeout, rollback) asks for a look at
once, and a look reads the deadline from the sandbox itself and, if it lies ahead, asks again for then.
"""
from __future__ import annotations

import heapq
from typing import Callable


class Deadlines:
    """Sandbox ids by the time of their next look; one live entry per id (a newer, earlier one wins)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, str]] = []
        self._at: dict[str, float] = {}       # id -> time of its live entry (others in the heap are stale)

    def __len__(self) -> int:
        return len(self._at)

    def look(self, sandbox_id: str, at: float = 0.0) -> None:
        """Look at this sandbox at `at` (unix time; 0: at the next tick), unless a look comes sooner."""
        if self._at.get(sandbox_id, float("inf")) <= at:
            return
        self._at[sandbox_id] = at
        heapq.heappush(self._heap, (at, sandbox_id))

    def next_at(self) -> float:
        """When the soonest live entry is due (inf: none)."""
        heap, at = self._heap, self._at
        while heap and at.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)           # stale
        return heap[0][0] if heap else float("inf")

    def due(self, now: float, deadline_of: Callable[[str], float | None]) -> list[str]:
        """The ids whose deadline has passed (each once), looking at every entry up to now. deadline_of(id):
        its deadline now, None when it has none (gone, ending, no TTL); a later one is looked at then."""
        out: list[str] = []
        later: list[tuple[str, float]] = []
        heap, at = self._heap, self._at
        while heap and heap[0][0] <= now:
            when, sid = heapq.heappop(heap)
            if at.get(sid) != when:
                continue                  # stale: a sooner look replaced it
            del at[sid]
            deadline = deadline_of(sid)
            if deadline is None:
                continue
            if deadline < now:
                out.append(sid)
            else:
                later.append((sid, deadline))
        for sid, deadline in later:       # (after the loop: a deadline of exactly now is looked at next tick)
            self.look(sid, deadline)
        return out
