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
from bus.errors import BusError
from bus.messages import encode
from bus.records import Booking, Heartbeat, NodeInfo
from bus.nodes import decode_node
from placement import scoring

log = logging.getLogger(__name__)

PHANTOM_WATCH = 30.0    # seconds a node is watched for a booking whose write was not confirmed (see settle())
PHANTOM_LOOK = 1.0
UNCERTAIN_KEPT = 10_000


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
        self.heard: dict[str, tuple[float, float]] = {}   # node -> (monotonic time of its last core heartbeat, run)
        self.cooled: dict[str, float] = {}   # node -> monotonic time a booking of it was taken back
        self.since = time.monotonic()        # when this view started listening
        self.hears_itself = lambda: True     # whether this engine's own connection works (a silence is then theirs)
        # request -> {node: its booking} whose write failed or timed out: it may still land (see settle())
        self.uncertain: dict[str, dict[str, Booking]] = {}
        self._removing: set[asyncio.Task] = set()

    # ---- liveness -------------------------------------------------------------------------------

    def on_heartbeat(self, hb: Heartbeat) -> None:
        """A node's core heartbeat (dsec.hb.<node>)."""
        self._heard(hb.node, hb.started_at)

    def _heard(self, node: str, started_at: float) -> None:
        now = time.monotonic()
        self.heard[node] = (now, started_at)
        cooled = self.cooled.get(node)
        if cooled is not None and now > cooled + 0.05:   # heard after the take-back: it is alive
            del self.cooled[node]
            self.on_room()

    def silent_for(self, node: str) -> float:
        """Seconds since this view heard a core heartbeat of node (since it started listening, if never)."""
        heard = self.heard.get(node)
        return time.monotonic() - (heard[0] if heard else self.since)

    def unresponsive(self) -> frozenset[str]:
        """Nodes not to book now: their core heartbeats stopped (late by several beats) while others' still
        come, or a booking of theirs was taken back for not being taken and no heartbeat came since."""
        if not self.judging():
            return frozenset(self.cooled)
        now = time.monotonic()
        late = {n for n, (at, _) in self.heard.items() if now - at > streams.SUSPECT_AFTER}
        return frozenset(late | set(self.cooled))

    def judging(self) -> bool:
        """Whether a node's silence may be held against it now: this engine hears itself, and some node was
        heard lately (when every node falls silent at once, the stall is shared or ours: nobody is judged)."""
        if not self.hears_itself():
            return False
        now = time.monotonic()
        return any(now - at < streams.SUSPECT_AFTER for at, _ in self.heard.values())

    def cool(self, node: str) -> None:
        """A booking of node was not taken in time: book it no more until it is heard from again."""
        self.cooled[node] = time.monotonic()

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
        if old is not None and info.heartbeat > old.info.heartbeat and not info.lost:
            self._heard(key, info.started_at)   # its own write of its record: a sign of life too
        if old is None or _more_room(old.info, info):
            self.on_room()

    def find_booking(self, request_id: str) -> str | None:
        """The live node holding a booking for this request, if any (a redelivered request placed before).
        A booking on a node that is lost or draining does not count: the request is placed afresh."""
        now = time.time()
        away = self.unresponsive()
        for key, e in self.entries.items():
            if request_id in e.info.bookings and scoring.placeable(e.info, e.info.pool, now) and key not in away:
                return key
        return None

    # ---- booking -------------------------------------------------------------------------------

    async def book(self, node: str, request_id: str, booking: Booking) -> bool:
        """Reserve room on node for a request; False when the node (as it is now) has no room, BusError
        when the bus did not say."""
        p = _Pending(request_id, booking)
        self._queues.setdefault(node, []).append(p)
        if node not in self._flushing:
            self._flushing.add(node)
            asyncio.get_running_loop().create_task(self._flush(node))
        return await p.future

    def settle(self, request_id: str, placed_on: str = "") -> None:
        """request_id is placed on placed_on (or ended: ""). A booking of it whose write failed or timed out on
        another node may still land there (a write the bus did not confirm, applied once a paused or moving
        KV leader goes on): it would hold room nobody uses until its deadline plus the edge's STALE_BOOKING,
        minutes for a create. Each such node is watched for PHANTOM_WATCH seconds, and that booking (this very
        write of it, by its `at`: a later booking of the same request is left alone) removed if it shows."""
        for node, booking in self.uncertain.pop(request_id, {}).items():
            if node != placed_on:
                self.discard(node, request_id, booking.at)

    def discard(self, node: str, request_id: str, at: float) -> None:
        """Remove the booking of request_id on node written at `at` (one nobody will take), as soon as this
        view shows it, within PHANTOM_WATCH seconds."""
        task = asyncio.get_running_loop().create_task(self._remove_phantom(node, request_id, at))
        self._removing.add(task)
        task.add_done_callback(self._removing.discard)

    async def _remove_phantom(self, node: str, request_id: str, at: float) -> None:
        until = time.monotonic() + PHANTOM_WATCH
        while time.monotonic() < until:
            e = self.entries.get(node)
            held = e.info.bookings.get(request_id) if e is not None else None
            if held is not None and held.at == at:
                try:
                    await _unbook_write(self, node, request_id, at)
                    log.warning("booking %s on %s removed: nobody will take it", request_id, node)
                    return
                except Exception as exc:
                    log.debug("booking %s on %s not removed yet: %s", request_id, node, exc)
            await asyncio.sleep(PHANTOM_LOOK)

    async def unbook(self, node: str, request_id: str) -> None:
        """Remove a booking the node never took (best effort: a stale booking ages out anyway)."""
        try:
            await _unbook_write(self, node, request_id)
        except Exception as exc:
            log.info("booking %s on %s not removed: %s", request_id, node, exc)

    async def _flush(self, node: str) -> None:
        try:
            while batch := self._queues.pop(node, []):
                accepted: set[str] = set()
                failed: BaseException | None = None
                try:
                    accepted = await self._commit(node, batch)
                except Exception as exc:   # the bus failed: not "no room" (their handlers try again later)
                    log.warning("booking on %s failed: %s", node, exc)
                    failed = exc if isinstance(exc, BusError) else BusError(f"booking on {node} failed: {exc}")
                    if len(self.uncertain) > UNCERTAIN_KEPT:   # (requests that never settled here)
                        self.uncertain.clear()
                    for p in batch:   # the write may still land: see settle()
                        self.uncertain.setdefault(p.request_id, {})[node] = p.booking
                finally:   # every waiter gets an answer, even when this flush is cancelled
                    for p in batch:
                        if p.future.done():
                            continue
                        if failed is not None:
                            p.future.set_exception(failed)
                        else:
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
                kind = p.booking.kind
                if scoring.can_ever_fit(info, p.booking.resources, kind) and scoring.fits(trial, p.booking.resources,
                                                                                          kind=kind):
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


async def _unbook_write(ledger: "NodeLedger", node: str, request_id: str, at: float | None = None) -> None:
    def mutate(raw: bytes | None) -> bytes | None:
        info = decode_node(node, raw)
        if info is None or request_id not in info.bookings or (at is not None and info.bookings[request_id].at != at):
            return None
        return encode(msgspec.structs.replace(info, bookings={k: v for k, v in info.bookings.items()
                                                                if k != request_id}))
    result = await ledger.bus.kv_update(streams.NODES_KV, node, mutate)
    if result.written:
        ledger.on_change(node, result.value, result.revision)


def _more_room(old: NodeInfo, new: NodeInfo) -> bool:
    a, b = scoring.free_of(old), scoring.free_of(new)
    return (b.slots > a.slots or b.cpu > a.cpu + 1e-9 or b.memory > a.memory or b.disk > a.disk
            or (old.draining and not new.draining) or (old.lost and not new.lost) or new.slots > old.slots)
