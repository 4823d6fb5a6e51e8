"""Node reservations with compare-and-set on each node's KV record (the ledger both sides update).

Placement adds a booking (request id -> resources, deadline) to a node's record only if the record,
at the revision it read, still has room for it; a concurrent writer (another engine, the edge's
heartbeat, a drain) makes the write fail and the booking is decided again on the fresh record. So no
node is ever booked beyond its capacity, whatever the number of engines. The edge removes a booking
in the same write that adds the sandbox to its usage, so the total never dips in between.

Within one engine, bookings for the same node are group-committed: whatever queued while one write
was in flight goes into the next single write.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import msgspec

from bus import streams
from bus.conn import Bus
from bus.messages import Booking, NodeInfo, encode, node_decoder
from placement import scoring

log = logging.getLogger(__name__)


def decode_node(key: str, raw: bytes | None) -> NodeInfo | None:
    """A node record, or None for junk or a record filed under another node's key."""
    if raw is None:
        return None
    try:
        info = node_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return info if info.node == key else None


@dataclass
class _Entry:
    info: NodeInfo
    raw: bytes
    revision: int


@dataclass
class _Pending:
    request_id: str
    booking: Booking
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class NodeLedger:
    """One engine's view of every node record, and its bookings on them."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.entries: dict[str, _Entry] = {}
        self._queues: dict[str, list[_Pending]] = {}
        self._flushing: set[str] = set()
        self.conflicts = 0
        self.on_room = lambda: None   # called when some node may have more room than before

    # ---- the view ------------------------------------------------------------------------------

    def nodes(self) -> list[NodeInfo]:
        """Every known node record."""
        return [e.info for e in self.entries.values()]

    def on_change(self, key: str, raw: bytes | None, revision: int) -> None:
        """KV watch callback (also fed with this engine's own writes); older revisions are ignored."""
        old = self.entries.get(key)
        if old is not None and revision <= old.revision:
            return
        info = decode_node(key, raw)
        if info is None:
            self.entries.pop(key, None)
            return
        self.entries[key] = _Entry(info, raw, revision)   # type: ignore[arg-type]
        if old is None or _more_room(old.info, info):
            self.on_room()

    def find_booking(self, request_id: str) -> str | None:
        """The live node holding a booking for this request, if any (a redelivered request placed before).
        A booking on a node that is lost or draining does not count: the request is placed afresh."""
        now = time.time()
        for key, e in self.entries.items():
            if request_id in e.info.bookings and scoring.placeable(e.info, e.info.pool, now):
                return key
        return None

    # ---- booking -------------------------------------------------------------------------------

    async def book(self, node: str, request_id: str, booking: Booking) -> bool:
        """Reserve room on node for a request; False when the node (as it is now) has no room."""
        p = _Pending(request_id, booking)
        self._queues.setdefault(node, []).append(p)
        if node not in self._flushing:
            self._flushing.add(node)
            asyncio.get_running_loop().create_task(self._flush(node))
        return await p.future

    async def _flush(self, node: str) -> None:
        try:
            while batch := self._queues.pop(node, []):
                accepted: set[str] = set()
                try:
                    accepted = await self._commit(node, batch)
                except Exception as exc:   # the bus failed: these requests are retried by their handlers
                    log.warning("booking on %s failed: %s", node, exc)
                finally:   # every waiter gets an answer, even when this flush is cancelled
                    for p in batch:
                        if not p.future.done():
                            p.future.set_result(p.request_id in accepted)
        finally:   # only a cancelled flush leaves waiters queued: they hear "no room" and try again
            self._flushing.discard(node)
            for p in self._queues.pop(node, []):
                if not p.future.done():
                    p.future.set_result(False)

    async def _commit(self, node: str, batch: list[_Pending]) -> set[str]:
        accepted: set[str] = set()

        def mutate(raw: bytes | None) -> bytes | None:
            accepted.clear()
            info = decode_node(node, raw)
            if info is None or not scoring.placeable(info, info.pool, time.time()):
                return None
            bookings = dict(info.bookings)
            for p in batch:
                if p.request_id in bookings:
                    accepted.add(p.request_id)   # booked before (a redelivery): still ours
                    continue
                trial = msgspec.structs.replace(info, bookings=bookings)
                if scoring.can_ever_fit(info, p.booking.resources) and scoring.fits(trial, p.booking.resources):
                    bookings[p.request_id] = p.booking
                    accepted.add(p.request_id)
            if len(bookings) == len(info.bookings):
                return None
            return encode(msgspec.structs.replace(info, bookings=bookings))

        e = self.entries.get(node)
        result = await self.bus.kv_update(streams.NODES_KV, node, mutate,
                                          known=(e.raw, e.revision) if e else None)
        self.conflicts += result.conflicts
        if result.written:
            self.on_change(node, result.value, result.revision)
        return accepted


def _more_room(old: NodeInfo, new: NodeInfo) -> bool:
    a, b = scoring.free_of(old), scoring.free_of(new)
    return (b.slots > a.slots or b.cpu > a.cpu + 1e-9 or b.memory > a.memory or b.disk > a.disk
            or (old.draining and not new.draining) or (old.lost and not new.lost) or new.slots > old.slots)


async def set_flag(bus: Bus, node: str, *, draining: bool | None = None, lost: bool | None = None,
                   lost_handled: bool | None = None, only_if_stale: float | None = None,
                   retry_lost_after: float | None = None) -> NodeInfo | None:
    """Set a node's draining / lost / lost_handled flag by compare-and-set. With only_if_stale, lost is
    set only while the heartbeat is older than that many seconds and the node is not lost already (so
    exactly one engine wins the claim); declaring a node lost drops its bookings (their creates are
    placed again). With retry_lost_after, an unfinished lost-node job older than that is taken over
    (lost_at refreshed). Returns the record written, or None when nothing was written."""
    def mutate(raw: bytes | None) -> bytes | None:
        info = decode_node(node, raw)
        if info is None:
            return None
        if only_if_stale is not None and (info.lost or time.time() - info.heartbeat < only_if_stale):
            return None
        if lost_handled is not None and not info.lost:
            return None   # it came back meanwhile
        if retry_lost_after is not None:   # take over an unfinished lost-node job (one engine wins)
            if not info.lost or info.lost_handled or time.time() - info.lost_at < retry_lost_after:
                return None
            return encode(msgspec.structs.replace(info, lost_at=time.time()))
        new = info
        if draining is not None:
            new = msgspec.structs.replace(new, draining=draining)
        if lost:
            new = msgspec.structs.replace(new, lost=True, lost_at=time.time(), lost_handled=False, bookings={})
        if lost_handled is not None:
            new = msgspec.structs.replace(new, lost_handled=lost_handled)
        return None if new == info else encode(new)

    result = await bus.kv_update(streams.NODES_KV, node, mutate)
    return node_decoder.decode(result.value) if result.written and result.value else None
