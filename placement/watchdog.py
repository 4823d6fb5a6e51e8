"""Bookings a node does not take: a create this engine booked on a node and sent to its lane, which the
node neither took (the booking is still in its record) within TAKE_WITHIN while it stopped beating, or
within PILE_UP at all, is taken back from the lane and placed again; the node is booked no more until
it is heard from (ledger.cool). So a node that dies stops holding creates within about a second, long
before it is declared lost.

Taking back is deleting the create's message from the node's lane by its stream sequence: once that
succeeds no consumer can be handed it again. If the node had it already (delivered, not yet acked),
both may start it, and the sandbox record's claim (edge/creates.py) lets exactly one of them do so.
A delete that finds nothing means the node consumed it: it took the create.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from bus import streams
from bus.conn import Bus
from bus.errors import BusError
from bus.messages import CreateRequest
from placement.ledger import NodeLedger

log = logging.getLogger(__name__)

TAKE_WITHIN = 0.5    # seconds a silent node has to take a booking before it is taken back
PILE_UP = 5.0        # seconds after which a booking is taken back even from a node that beats
LOOK_EVERY = 0.1     # seconds between two looks at the bookings watched


@dataclass
class _Watched:
    req: CreateRequest   # as placed (with its node)
    seq: int             # its message on the node's lane
    at: float            # monotonic time it was sent


class BookingWatch:
    """The bookings one engine made and is waiting to see taken."""

    def __init__(self, bus: Bus, ledger: NodeLedger, place_again: Callable[[CreateRequest], Awaitable[None]]) -> None:
        self.bus = bus
        self.ledger = ledger
        self.place_again = place_again
        self._watched: dict[str, _Watched] = {}
        self.taken_back = 0
        self.recovery: list[float] = []   # seconds from a booking to its taking back (the latest few)

    def watch(self, req: CreateRequest, seq: int) -> None:
        """A create was sent to req.node's lane as message seq."""
        if seq > 0:
            self._watched[req.request_id] = _Watched(req, seq, time.monotonic())

    async def run(self) -> None:
        """Look at what is watched every LOOK_EVERY seconds, forever."""
        while True:
            await asyncio.sleep(LOOK_EVERY)
            now = time.monotonic()
            for rid, w in list(self._watched.items()):
                if now - w.at < TAKE_WITHIN:
                    continue
                try:
                    await self._look(rid, w, now)
                except BusError as exc:   # the lane or the record is unavailable now: look again soon
                    log.debug("booking %s on %s not checked: %s", rid, w.req.node, exc)
                except Exception:
                    log.exception("booking %s on %s not checked", rid, w.req.node)
                    self._watched.pop(rid, None)

    async def _look(self, rid: str, w: _Watched, now: float) -> None:
        node = w.req.node
        entry = self.ledger.entries.get(node)
        if entry is None or rid not in entry.info.bookings or entry.info.lost:
            self._watched.pop(rid, None)   # taken (or the node is gone: the reaper places its lane again)
            return
        if self.ledger.silent_for(node) < TAKE_WITHIN and now - w.at < PILE_UP:
            return   # it beats: it may only be slow to write its record
        removed = await self.bus.delete_msg(streams.NODE_STREAM, w.seq)
        self._watched.pop(rid, None)
        if not removed:
            return   # consumed already: the node took it
        self.ledger.cool(node)
        self.taken_back += 1
        self.recovery = [*self.recovery[-63:], now - w.at]
        log.warning("create %s booked on %s was not taken in %.1fs: placed again elsewhere", rid, node, now - w.at)
        await self.ledger.unbook(node, rid)
        await self.place_again(w.req)
