"""The placement engine: any number of them pull create requests from the shared durable consumers
(one per priority), book room on a node by compare-and-set, and route each request to its node's lane.
Local nodes first: past the burst threshold, a burstable create that fits on no local node is booked
on a node of the burst pool (bounded by that pool's room). A node that does not take a booking is
watched (placement/watchdog.py); one that stopped beating is booked no more.

A request that fits nowhere is held (leased, unacked) while it waits for room, up to `max_waiting`
per priority per engine; beyond that it waits in JetStream, unpulled. Latency requests have their own
consumer, so they never queue behind batch ones, and they take freed room first.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import socket
import time

import msgspec

from bus import kinds, lanes, streams, subjects
from bus.conn import Bus, kv_watch
from bus.errors import BusError, CapacityUnavailable, DsecError, InvalidRequest, RequestExpired, SandboxNotFound
from bus.messages import CreateRequest, ErrorReply, Queued, SandboxReady, create_decoder, encode
from bus.records import Booking, EngineStats, ImageConfig, SnapshotRecord, SandboxRecord, heartbeat_decoder
from bus.pull import Delivery, Verdict
from bus import validate
from placement import scoring
from placement.api import ControlApi
from bus.images import ImageRegistry
from placement.ledger import NodeLedger
from placement.quota import Quotas
from edge.records import SandboxRecords, lifecycle
from placement.reaper import Reaper
from placement.watchdog import BookingWatch

log = logging.getLogger(__name__)

WAIT_POLL = 1.0          # a waiting request looks again at least this often
BOOK_TRIES = 3           # nodes tried per attempt before waiting for room
LANE_ROOM = 4096         # bytes a placed request may still gain on its way to a node (its node id, headers)


def node_msg_id(req: CreateRequest) -> str:
    """The msg id of a placed create: JetStream drops a second placement of the same request."""
    return req.request_id if req.attempt == 0 else f"{req.request_id}.{req.attempt}"


def _engine_name() -> str:
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())[:40]
    return f"{host}-{os.getpid()}-{os.urandom(2).hex()}"


class PlacementEngine:
    """One engine; any number may run against the same consumers."""

    def __init__(self, bus: Bus, *, max_waiting: int = 32, burst_threshold: float = 0.8,
                 burst_pool: str = "cloud", pool: str = "local", name: str | None = None) -> None:
        if not 0 < burst_threshold <= 1:
            raise InvalidRequest(f"burst threshold must be in (0, 1], got {burst_threshold}")
        if max_waiting < 1:
            raise InvalidRequest(f"max waiting must be at least 1, got {max_waiting}")
        self.bus = bus
        self.name = name or _engine_name()
        self.images = ImageRegistry(bus)
        self.ledger = NodeLedger(bus)
        self.ledger.on_room = self._room_changed
        self.quotas = Quotas(bus)
        self.reaper = Reaper(bus, self.ledger, self.name)
        self.watch = BookingWatch(bus, self.ledger, self._place_again)
        self.ledger.hears_itself = self.reaper.hears_itself
        self.records = SandboxRecords(bus, "")
        self.api = ControlApi(bus, self.images, self.quotas, nodes=self.ledger.nodes)
        self.outcomes: collections.Counter = collections.Counter()   # (message kind, verdict) -> creates handled
        self.max_waiting = max_waiting
        self.burst_threshold = burst_threshold
        self.burst_pool, self.pool = burst_pool, pool
        self._room = asyncio.Event()
        self._workers: list = []
        self._tasks: list[asyncio.Task] = []
        self._subs: list = []
        self.waiting = {p: 0 for p in subjects.PRIORITIES}   # in _wait_room now
        self.queued = {p: 0 for p in subjects.PRIORITIES}    # found no room at least once, not placed yet
        self.placed = self.bursted = self.rejected = 0
        self.burst_min_utilization = 1.0   # lowest local utilization seen at a burst decision
        self._latencies: collections.deque[float] = collections.deque(maxlen=4096)

    # ---- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Watch nodes and quotas, then pull both priorities."""
        # every edge heartbeats every few seconds: a node watch silent for longer has lost its server
        self._subs.append(await self.bus.subscribe(subjects.heartbeat(), self._heartbeat))
        self._tasks = [await kv_watch(self.bus, streams.NODES_KV, self.ledger.on_change, resync_every=4.0,
                                      on_synced=lambda _keys: setattr(self.api, "nodes_known", True)),
                       await kv_watch(self.bus, streams.QUOTAS_KV, self.quotas.on_change),
                       await kv_watch(self.bus, streams.IMAGES_KV, self.images.on_change),   # drops stale resolves
                       await kv_watch(self.bus, streams.ENGINES_KV, self.api.on_engine),   # the rate's share
                       *await self.reaper.start(), asyncio.create_task(self.watch.run()),
                       asyncio.create_task(self._stats_loop())]
        await self.api.start()
        for prio in subjects.PRIORITIES:
            self._workers.append(await self.bus.pull_worker(
                streams.placement_consumer(prio), self._handler(prio), credit=lambda: self.max_waiting,
                steps=[lanes.counted(self.outcomes), lanes.retried_on_bus_errors(0.5, "create request"),
                       lanes.leased(streams.PLACEMENT_LEASE_EVERY),
                       *lanes.tenant_lane(self.bus, create_decoder, "create", 4, 5)]))   # dsec.req.create.<prio>.<tenant>

    async def stop(self) -> None:
        """Stop pulling; requests in flight are dropped unacked (another engine gets them)."""
        await self.api.stop()
        await asyncio.gather(*(w.stop(drain=False) for w in self._workers), return_exceptions=True)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for sub in [*self._subs, *self.reaper.subscriptions()]:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()
        try:
            await asyncio.wait_for(self.bus.kv_delete(streams.ENGINES_KV, self.name), 0.5)
        except (asyncio.TimeoutError, DsecError):
            pass

    async def _heartbeat(self, data: bytes, _subject: str) -> None:
        try:
            self.ledger.on_heartbeat(heartbeat_decoder.decode(data))
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass

    # ---- figures -------------------------------------------------------------------------------

    def utilization(self) -> float:
        """Booked share of the local pool's tightest dimension."""
        return scoring.utilization(self.ledger.nodes(), self.pool)

    def stats(self) -> EngineStats:
        """This engine's figures now."""
        lat = sorted(self._latencies)
        pick = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))]) if lat else (lambda q: 0.0)
        return EngineStats(engine=self.name, placed=self.placed, bursted=self.bursted, rejected=self.rejected,
                           queued=sum(self.waiting.values()), conflicts=self.ledger.conflicts,
                           latency_p50=pick(0.5), latency_p99=pick(0.99), utilization=self.utilization(),
                           threshold=self.burst_threshold, burst_min_utilization=self.burst_min_utilization,
                           taken_back=self.watch.taken_back, take_back_max=max(self.watch.recovery, default=0.0),
                           at=time.time())

    async def _stats_loop(self) -> None:
        while True:
            try:
                await self.bus.kv_put(streams.ENGINES_KV, self.name, self.stats())
            except DsecError as exc:
                log.debug("stats not published: %s", exc)
            await asyncio.sleep(1.0)

    # ---- waiting for room ----------------------------------------------------------------------

    def _room_changed(self) -> None:
        self._room.set()
        self._room = asyncio.Event()

    async def _wait_room(self, req: CreateRequest) -> None:
        room = self._room
        self.waiting[req.priority] += 1
        try:
            await asyncio.wait_for(room.wait(), max(0.0, min(WAIT_POLL, req.deadline - time.time())))
        except asyncio.TimeoutError:
            pass
        finally:
            self.waiting[req.priority] -= 1

    # ---- handling ------------------------------------------------------------------------------

    def _handler(self, priority: str):
        async def handle(d: Delivery) -> Verdict:
            return await self._handle(d, priority)
        return handle

    async def _event(self, req: CreateRequest, type_: str, detail: str) -> None:
        await self.records.note(req.tenant, req.sandbox_id, type_, req.request_id, detail)

    async def _reject(self, req: CreateRequest, err: DsecError, admitted: bool = False,
                      expired: bool = False) -> Verdict:
        self.rejected += 1
        self.ledger.settle(req.request_id)   # (a booking of it whose write was not confirmed goes)
        if admitted:   # it may hold quota and a client may look it up: record how it ended
            now = time.time()
            state = "expired" if expired or isinstance(err, RequestExpired) else "failed"
            rec = SandboxRecord(sandbox_id=req.sandbox_id, tenant=req.tenant, state=state, image=req.image, backend=req.backend,
                                labels=dict(req.labels), resources=req.resources, created_at=now,
                                updated_at=now, reason=str(err), request_id=req.request_id, version=1)
            # only if no edge claimed it meanwhile (its record is then the truth); a bus error NAKs the
            # request: its redelivery finds the record and publishes what is missing
            await self.records.reject(rec, lifecycle(rec, "rejected", node="", request_id=req.request_id,
                                                     detail=str(err)))
        await self.bus.reply(req.reply_to, ErrorReply(request_id=req.request_id, code=err.code, message=str(err)))
        if not admitted:
            await self._event(req, "rejected", str(err))
        return Verdict.ACK

    async def _handle(self, d: Delivery, priority: str) -> Verdict:
        req = msgspec.structs.replace(d.msg, priority=priority)   # the subject it came on decides (and its tenant)
        try:
            validate.check_create(req)
            if validate.expired(req.deadline):
                raise RequestExpired("create request expired before it was placed")
            pin = ""
            if req.snapshot:
                snap = await self.images.snapshot(req.snapshot, req.tenant)
                layers, pin = list(snap.layers), _memory_pin(req, snap)
            else:
                layers = await self.images.compose(req.image, req.workspace, req.toolkit)
                config = await self.images.config(req.image)   # an imported image's defaults (cached)
                if config != ImageConfig():
                    req = msgspec.structs.replace(req, env={**config.env, **req.env}, cwd=req.cwd or config.cwd,
                                                  user=req.user or config.user,
                                                  command=[*config.entrypoint, *config.cmd])
            self._never_fits(req, pin)
            placed = msgspec.structs.replace(req, layers=layers)
            self._fits_a_lane(placed)
            await self.quotas.admit(req)
        except BusError:
            raise
        except DsecError as err:
            return await self._reject(req, err)
        if (d.num_delivered > 1 or req.attempt) and await self._served(req):
            return Verdict.ACK   # placed before and taken by a node (an ack lost with a server): answered
        queued, why = False, ""
        try:
            while True:
                try:
                    if validate.expired(req.deadline):   # after waiting for room it is a capacity outcome,
                        if queued:                          # as the SDK says when its own timer ends first
                            raise CapacityUnavailable(f"no node had room before the create's deadline "
                                                      f"(queued: {why})")
                        raise RequestExpired("the create's deadline passed before it was placed")
                    if await self._try_place(placed, pin):
                        return Verdict.ACK
                    self._never_fits(req, pin)
                except BusError:
                    raise
                except DsecError as err:   # (its record says expired when its deadline ended the wait)
                    return await self._reject(req, err, admitted=True, expired=validate.expired(req.deadline))
                if not queued:
                    queued = True
                    self.queued[req.priority] += 1
                    why = "no live node" if not self._live(self.pool) else "no node has room"
                    await self.bus.reply(req.reply_to, Queued(request_id=req.request_id, reason=why))
                    await self._event(req, "queued", why)
                await self._wait_room(req)
        finally:
            if queued:
                self.queued[req.priority] -= 1

    def _fits_a_lane(self, placed: CreateRequest) -> None:
        """InvalidRequest, before any booking, when the request as a node's lane gets it (its layers and its
        image's env and command added) is larger than the NATS server takes (LANE_ROOM spare for the node's
        id and the headers). Sent anyway, the server would close placement's connection."""
        limit = getattr(self.bus.nc, "max_payload", 0)
        size = len(encode(placed))
        if limit and size + LANE_ROOM > limit:
            raise InvalidRequest(f"create request too large: {size:,} bytes with its image's layers and config, "
                                 f"at most {limit - LANE_ROOM:,} (the NATS server's max_payload)")

    async def _served(self, req: CreateRequest) -> bool:
        """Whether a request delivered again already has a sandbox (ready) or an outcome: then it is answered
        from its record and booked nowhere again. A `starting` one is placed as usual (its node may have
        died: the claim decides who starts it)."""
        rec, _ = await self.records.get(req.tenant, req.sandbox_id)
        if rec is None or rec.request_id != req.request_id:
            return False
        if rec.state == "starting":   # a live node is on it (it answers; if it dies, the reaper places it again)
            return rec.node in self.ledger.entries and rec.node not in self.ledger.unresponsive() \
                and not self.ledger.entries[rec.node].info.lost
        if not rec.node:   # placement's own rejection: its event may not be out yet
            await self.records.reject(rec, lifecycle(rec, "rejected", node="", request_id=req.request_id,
                                                     detail=rec.reason))
        if rec.state == "ready":
            await self.bus.reply(req.reply_to, SandboxReady(request_id=req.request_id, sandbox_id=req.sandbox_id,
                                                         node=rec.node))
        else:
            await self.bus.reply(req.reply_to, ErrorReply(request_id=req.request_id, code=SandboxNotFound.code,
                                                       reason=rec.state, message=f"sandbox {req.sandbox_id} "
                                                       f"{rec.state}: {rec.reason}"))
        return True

    def _live(self, pool: str) -> list:
        now = time.time()
        return [i for i in self.ledger.nodes() if scoring.placeable(i, pool, now)]

    def _never_fits(self, req: CreateRequest, pin: str = "") -> None:
        """CapacityUnavailable when live nodes exist but none runs the request's kind (naming the kinds
        they run), or none could ever hold the request; or, pinned to a node (a fork from memory), that node
        is not live (its memory snapshots died with it)."""
        live = self._live(self.pool) + (self._live(self.burst_pool) if req.may_burst() else [])
        if pin:
            live = [i for i in live if i.node == pin]
            if not live:
                raise CapacityUnavailable(f"the memory of snapshot {req.snapshot} is held by node {pin}, which is "
                                          f"not live: create from it with memory=False for its files",
                                          reason="memory_node_lost")
        if not live:
            return   # no live node yet: it waits for one
        offered = scoring.kinds_offered(live)
        if req.backend not in offered:
            raise CapacityUnavailable(f"no node runs backend {req.backend!r}; the live nodes run: "
                                      f"{', '.join(offered) or 'nothing'}", reason="kind_not_offered")
        r = kinds.booked(req.backend, req.resources)
        if not any(scoring.can_ever_fit(i, r, req.backend) for i in live):
            raise CapacityUnavailable(f"no node can ever fit resources (of a {req.backend} sandbox) "
                                      f"{msgspec.structs.asdict(req.resources)}")

    def _burst_ready(self, req: CreateRequest) -> bool:
        if not req.may_burst():
            return False
        r = kinds.booked(req.backend, req.resources)
        if not any(scoring.can_ever_fit(i, r, req.backend) for i in self._live(self.burst_pool)):
            return False
        util = self.utilization()
        if util < self.burst_threshold:
            return False
        self.burst_min_utilization = min(self.burst_min_utilization, util)
        return True

    async def _try_place(self, req: CreateRequest, pin: str = "") -> bool:
        """Route the request once: True when it is on a lane (or was before), False when nothing has room.
        pin: the only node it may go to (a fork from memory).

        Local room first: only a create that fits on no local node bursts, and only onto a node of the
        burst pool with room, booked like any other (so the burst pool never holds more than its room)."""
        prior = self.ledger.find_booking(req.request_id)
        if prior is not None and prior not in req.avoid:   # a redelivery booked before: same node, same msg id
            await self._send(msgspec.structs.replace(req, node=prior))
            self.ledger.settle(req.request_id, prior)
            return self._routed(req)
        if req.priority == "batch" and self.queued["latency"]:
            return False   # strict priority: while a latency request waits here, freed room is its
        tried: set[str] = set(req.avoid)   # nodes where its environment failed: elsewhere if anywhere fits
        kind, r = req.backend, kinds.booked(req.backend, req.resources)
        prefer = scoring.affinity(req.layers, req.resources, kind, req.tenant)
        for _ in range(BOOK_TRIES):
            nodes = self.ledger.nodes()
            away = self.ledger.unresponsive()
            if pin:
                away |= {i.node for i in nodes if i.node != pin}
            node, _ever = scoring.choose(nodes, r, pool=self.pool, exclude=frozenset(tried) | away,
                                         prefer=prefer, kind=kind)
            if node is None and req.avoid and tried == set(req.avoid):
                tried = set()   # nowhere else: a fresh environment on the same node is the retry
                node, _ever = scoring.choose(nodes, r, pool=self.pool, exclude=away, kind=kind)
            burst = False
            if node is None and not pin and self._burst_ready(req):   # the excess that does not fit locally
                node, _ever = scoring.choose(nodes, r, pool=self.burst_pool,
                                             exclude=frozenset(tried) | away, prefer=prefer, kind=kind)
                burst = node is not None
            if node is None:
                return False
            booking = Booking(resources=r, deadline=req.deadline, tenant=req.tenant, kind=kind, at=time.time())
            if await self.ledger.book(node, req.request_id, booking):
                await self._send(msgspec.structs.replace(req, node=node), booking.at)
                self.bursted += burst
                self.ledger.settle(req.request_id, node)
                return self._routed(req)
            tried.add(node)
        return False

    async def _send(self, placed: CreateRequest, booked_at: float | None = None) -> None:
        """Put a booked create on its node's lane, and watch that the node takes it. Not stored when an
        earlier delivery of the request placed it already (its ack was lost, a paused server's redeliveries):
        the booking just made for it (written at booked_at) would then hold room nobody takes until its
        deadline plus the edge's STALE_BOOKING, minutes, and is removed instead."""
        seq, new = await self.bus.publish_once(subjects.node_create(placed.node), encode(placed),
                                               msg_id=node_msg_id(placed))
        if not new and booked_at is not None:
            self.ledger.discard(placed.node, placed.request_id, booked_at)
        self.watch.watch(placed, seq)

    async def _place_again(self, req: CreateRequest) -> None:
        """A create its node did not take (see placement/watchdog.py): back to placement, attempt + 1."""
        again = msgspec.structs.replace(req, node="", pool="", attempt=req.attempt + 1)
        await self.bus.publish(subjects.create_request(again.tenant, again.priority), encode(again),
                               msg_id=f"{again.request_id}.{again.attempt}", retries=3, retry_for=5.0)

    def _routed(self, req: CreateRequest) -> bool:
        self.placed += 1
        if req.sent_at:
            self._latencies.append(max(0.0, time.time() - req.sent_at))
        return True


def _memory_pin(req: CreateRequest, snap: SnapshotRecord) -> str:
    """The node a create from snap must run on: its memory's, when the create asks for the memory (then of
    the snapshot's kind and resources: InvalidRequest otherwise); '' when any node may."""
    if not req.memory:
        return ""
    if not snap.memory_node:
        raise InvalidRequest(f"snapshot {snap.id} has no memory (take one with snapshot(memory=True))")
    if req.backend != snap.memory_kind:
        raise InvalidRequest(f"snapshot {snap.id}'s memory is of a {snap.memory_kind}, not a {req.backend}")
    if req.resources != snap.resources:
        raise InvalidRequest(f"snapshot {snap.id}'s memory fixes the resources: "
                             f"{msgspec.structs.asdict(snap.resources)}, asked {msgspec.structs.asdict(req.resources)}")
    return snap.memory_node
