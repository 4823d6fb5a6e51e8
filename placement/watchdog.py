"""Bookings a node does not take: a create this engine booked on a node and sent to its lane is taken back
from the lane and placed again when the node went silent (neither a core heartbeat nor a write of its record
for TAKE_WITHIN: all its untaken creates at once), or when it is heard from but its lane has handed out
nothing for PILE_UP (it takes nothing; a lane that moves works through its backlog, however deep). The node is then booked no more until it is heard from (ledger.cool). So a node that
dies stops holding creates within about half a second, long before it is declared lost.

Taking back is deleting the create's message from the node's lane by its stream sequence: once that
succeeds no consumer can be handed it again. If the node had it already (delivered, not yet acked),
both may start it, and the sandbox record's claim (edge/creates.py) lets exactly one of them do so.
A delete that finds nothing means the node consumed it: it took the create.
"""
from __future__ import annotations

import asyncio
import collections
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

TAKE_WITHIN = 0.5    # seconds of a node's silence after which its untaken creates are taken back
PILE_UP = 5.0        # seconds a beating node's lane may hand out nothing before its waiting creates go back
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
        self._handed: dict[str, tuple[int, float]] = {}   # node -> (its lane's last handed-out seq, since when)
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
            by_node: dict[str, list[_Watched]] = collections.defaultdict(list)
            for rid, w in list(self._watched.items()):
                entry = self.ledger.entries.get(w.req.node)
                if entry is not None and not entry.info.lost and rid not in entry.info.bookings:
                    del self._watched[rid]   # taken (its booking left the record)
                else:                        # (a lost node's: taken back too, under the reaper's msg id)
                    by_node[w.req.node].append(w)
            for node, watched in by_node.items():
                try:
                    await self._look(node, watched)
                except BusError as exc:   # the lane or the record is unavailable now: look again soon
                    log.debug("bookings on %s not checked: %s", node, exc)
                except Exception:
                    log.exception("bookings on %s not checked", node)

    async def _look(self, node: str, watched: list[_Watched]) -> None:
        now = time.monotonic()
        entry = self.ledger.entries.get(node)
        if entry is None or entry.info.lost or self.ledger.silent_for(node) >= TAKE_WITHIN:
            if not (entry is None or entry.info.lost or self.ledger.judging()):
                return                                   # the silence may be ours, or everyone's
            due = watched                                # silent: everything it has not taken
        else:
            due = [w for w in watched if now - w.at >= PILE_UP]
            if not due:
                return
            durable = streams.edge_create_consumer(node)[1].durable_name
            handed = await self.bus.consumer_delivered(streams.NODE_STREAM, durable)
            last, since = self._handed.get(node, (-1, now))
            if handed != last:   # its lane moves: it works through a backlog, however deep
                self._handed[node] = (handed, now)
                return
            if now - since < PILE_UP:
                return
            due = [w for w in due if w.seq > handed]     # handed out: the node is on it (its record is late)
        for w in due:
            await self._take_back(node, w, now)

    async def _take_back(self, node: str, w: _Watched, now: float) -> None:
        """Placed again first (a failure keeps it watched: nothing is lost), then taken off the lane."""
        rid = w.req.request_id
        self.ledger.cool(node)
        await self.place_again(w.req)
        self._watched.pop(rid, None)
        removed = await self.bus.delete_msg(streams.NODE_STREAM, w.seq)
        await self.ledger.unbook(node, rid)
        if removed:   # (else the node had consumed it: the sandbox record's claim keeps one of the two)
            self.taken_back += 1
            self.recovery = [*self.recovery[-63:], now - w.at]
            log.warning("create %s booked on %s was not taken in %.1fs: placed again elsewhere", rid, node,
                        now - w.at)
