"""The edge's side of its node record (KV dsec-nodes): heartbeat, capacity, usage, taken bookings.

Every write is a compare-and-set on the record's revision, rebuilt on the fresh record after a
conflict: the edge owns capacity, usage and heartbeat; placement owns the bookings it adds; an
operator owns `draining`. A booking is removed in the same write that counts its sandbox in the usage,
so placement's view (usage + bookings) never dips below the truth. Bookings whose request deadline
passed long ago are dropped (their placement died or their request expired).

Writes are coalesced: at most one in flight; changes meanwhile go into the next one, which follows
after MIN_GAP. With no change, a heartbeat every `config.heartbeat` seconds. Beside the record, a core
heartbeat goes to dsec.hb.<node> every HEARTBEAT_EVERY: it needs no JetStream leader, so a node bucket
that is briefly leaderless (a server lost, an election) never makes a live node look dead.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import msgspec

from bus import streams, subjects
from bus.conn import Bus
from bus.errors import DsecError
from bus.messages import encode
from bus.records import Heartbeat, node_decoder
from edge.capacity import Capacity

log = logging.getLogger(__name__)

MIN_GAP = 0.025         # seconds between two writes under load
STALE_BOOKING = 10.0    # seconds past its deadline a booking nobody took is dropped


class NodeRecord:
    """Writes this node's record; tells the edge when an operator drains or undrains it."""

    def __init__(self, bus: Bus, capacity: Capacity, on_draining: Callable[[bool], None],
                 on_lost: Callable[[], None] = lambda: None, inventory: Callable[[], dict] = dict) -> None:
        self.bus = bus
        self.capacity = capacity
        self.node = capacity.config.node_id
        self.on_draining = on_draining
        self.on_lost = on_lost
        self.inventory = inventory   # extra NodeInfo fields: warm stock, layers held
        self._declared_lost = False
        self.draining = False
        self.started_at = time.time()
        self._taken: set[str] = set()
        self._dirty = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._beats: asyncio.Task | None = None
        self.writes = 0
        self.beats = 0

    def took(self, request_id: str) -> None:
        """A create was taken (its sandbox is now in the usage): drop its booking with the next write."""
        self._taken.add(request_id)
        self._dirty.set()

    def changed(self) -> None:
        """Usage changed: write soon."""
        self._dirty.set()

    async def write(self) -> None:
        """One write now (compare-and-set, retried on conflict)."""
        # `taken` is read when the record is built (after any await of a retry), together with the usage:
        # a create counted in the usage always has its booking removed in the same write.
        used: set[str] = set()

        def build(raw: bytes | None) -> bytes:
            used.clear()
            used.update(self._taken)
            return self._build(raw, used)

        result = await self.bus.kv_update(streams.NODES_KV, self.node, build)
        self._taken -= used
        if self._declared_lost:   # declared lost while we ran (our heartbeats did not land in time);
            self._declared_lost = False   # kept pending until a write lands, so it is never missed
            self.on_lost()
        self.writes += 1
        info = node_decoder.decode(result.value) if result.value else None
        if info is not None and info.draining != self.draining:
            self.draining = info.draining
            self.on_draining(self.draining)

    def _build(self, raw: bytes | None, taken: set[str]) -> bytes:
        prior = None
        if raw is not None:
            try:
                prior = node_decoder.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError):
                prior = None   # junk under our key: overwrite it
        now = time.time()
        # an operator's drain holds across a restart; a stop's (one cut short left it) does not (helper T2: the
        # node came back draining, refusing every create)
        ours = prior is not None and prior.node == self.node
        earlier_stop = ours and prior.stopping and prior.started_at != self.started_at
        draining, stopping = (prior.draining, prior.stopping) if ours and not earlier_stop else (False, False)
        info = msgspec.structs.replace(self.capacity.node_info(draining=draining), stopping=stopping)
        bookings = {}
        self._declared_lost = self._declared_lost or bool(prior and prior.node == self.node and prior.lost
                                                          and prior.started_at == self.started_at)
        if prior is not None and prior.node == self.node:
            bookings = {rid: b for rid, b in prior.bookings.items()
                        if rid not in taken and now < b.deadline + STALE_BOOKING}
        return encode(msgspec.structs.replace(info, **self.inventory(), bookings=bookings, lost=False, lost_handled=False, lost_at=0.0,
                                              started_at=self.started_at, heartbeat=now))

    def start(self, heartbeat: float) -> None:
        """Start the writer loop (after a first write()) and the core heartbeats."""
        self._task = asyncio.create_task(self._loop(heartbeat))
        self._beats = asyncio.create_task(self._beat())

    async def stop(self) -> None:
        """Stop writing and beating (the caller deletes the record)."""
        tasks = [t for t in (self._task, self._beats) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _beat(self) -> None:
        subject = subjects.heartbeat(self.node)
        while True:
            self.beats += 1
            try:
                await self.bus.send(subject, Heartbeat(node=self.node, started_at=self.started_at, seq=self.beats,
                                                       at=time.time()))
            except DsecError as exc:
                log.debug("heartbeat not sent: %s", exc)
            await asyncio.sleep(streams.HEARTBEAT_EVERY)

    async def _loop(self, heartbeat: float) -> None:
        while True:
            try:
                await asyncio.wait_for(self._dirty.wait(), heartbeat)
            except asyncio.TimeoutError:
                pass
            self._dirty.clear()
            try:
                await self.write()
            except DsecError as exc:
                log.warning("node record not written: %s", exc)
                self._dirty.set()
                await asyncio.sleep(0.5)
            await asyncio.sleep(MIN_GAP)

