"""The places of the node's mirrors: how many connections each sandbox, and each tenant's sandboxes together,
hold to the node's package mirrors, and who waits for one.

The mirrors serve every tenant: one mirror-only sandbox's 250 slow connections left apt-cacher-ng answering
no one (helper A3). A sandbox holds at most MIRROR_PER_SANDBOX, its tenant's sandboxes MIRROR_PER_TENANT;
more wait (aether.proxy), in turn, for a place to be handed over: each end woke every waiter on the node once,
and 2,350 of one tenant's made each end cost 9 ms of the proxy, another tenant's fetches 100-380 ms (helper A4).
"""
from __future__ import annotations

import asyncio
import collections

from aether.policy import SandboxState

MIRROR_PER_SANDBOX = 16     # connections one sandbox holds to the node's mirrors at once (pip and apt use a few)
MIRROR_PER_TENANT = 128     # ... and one tenant's sandboxes together (100 installing at once fit)


class MirrorPlaces:
    def __init__(self) -> None:
        self.held: collections.Counter[str] = collections.Counter()   # owner -> connections to the mirrors
        self.queued: dict[str, dict[SandboxState, None]] = {}   # owner -> its sandboxes with waiters, in turn

    def room(self, sb: SandboxState) -> bool:
        return sb.mirror_open < MIRROR_PER_SANDBOX and self.held[sb.owner] < MIRROR_PER_TENANT

    def full(self, sb: SandboxState) -> str:
        """What keeps sb from a place (for a refusal)."""
        return (f"the sandbox has {MIRROR_PER_SANDBOX}" if sb.mirror_open >= MIRROR_PER_SANDBOX
                else f"its tenant's sandboxes have {MIRROR_PER_TENANT}")

    def take(self, sb: SandboxState) -> None:
        sb.mirror_open += 1
        self.held[sb.owner] += 1

    def queue(self, sb: SandboxState, handed: asyncio.Future) -> None:
        """handed waits for a place of sb's (its result is set once one is taken for it)."""
        sb.mirror_queue.append(handed)
        sb.mirror_waiting += 1
        self.queued.setdefault(sb.owner, {})[sb] = None

    def unqueue(self, sb: SandboxState, handed: asyncio.Future) -> None:
        """A waiter that gave up (left in the queue, skipped when reached)."""
        handed.cancel()
        sb.mirror_waiting -= 1
        if not sb.mirror_waiting:
            self._settled(sb)

    def give(self, sb: SandboxState) -> None:
        """A place of sb's ends: handed to the first waiter of the first of its tenant's sandboxes, in turn,
        that has room of its own (sb's own first waiters took every place it freed, and a sandbox of the same
        tenant with none waited out its 60 s: review R5); that sandbox goes to the end of the turn."""
        sb.mirror_open -= 1
        less(self.held, sb.owner)
        queued = self.queued.get(sb.owner)
        if not queued:
            return
        for other in list(queued):
            if not self.room(other):
                continue
            while other.mirror_queue:
                handed = other.mirror_queue.popleft()
                if not handed.done():
                    self.take(other)
                    handed.set_result(None)
                    other.mirror_waiting -= 1
                    if not other.mirror_waiting:
                        self._settled(other)
                    else:
                        del queued[other]
                        queued[other] = None
                    return

    def _settled(self, sb: SandboxState) -> None:
        """sb has no waiter left."""
        sb.mirror_queue.clear()
        queued = self.queued.get(sb.owner, {})
        queued.pop(sb, None)
        if not queued:
            self.queued.pop(sb.owner, None)


def less(counts: collections.Counter, key: str) -> None:
    """One fewer for key (gone at none: the proxy's counters hold only owners with connections open)."""
    counts[key] -= 1
    if counts[key] <= 0:
        del counts[key]
