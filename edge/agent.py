"""The edge: a node agent. Pulls its own create lane (only as many as it has room for) and op lane."""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import secrets
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from bus import streams, subjects
from bus.conn import Bus
from bus.errors import (BusError, CapacityUnavailable, DsecError, EnvironmentFailure, InvalidRequest,
                        RequestExpired, SandboxNotFound)
from bus.messages import (CreateRequest, ErrorReply, Event, LayerRef, SandboxReady, SandboxRecord, SnapshotRecord,
                          TrajRecord, create_decoder, encode, salvage, sandbox_decoder)
from bus.pull import Delivery, Lease, Verdict
from edge.backends.base import Backend, BackendError, LayerUnusable, SandboxSpec
from edge.capacity import Capacity, EdgeConfig
from edge.layercache import LayerCache
from edge.noderecord import NodeRecord
from edge.ops import OpLane
from edge.warmpool import WarmPools, limits
from placement import admission

log = logging.getLogger(__name__)

BUS_CLEANUP_TIMEOUT = 1.0   # cleanup never waits on the bus longer than this
STOP_BUS_BUDGET = 1.5       # seconds for everything a stop does before the backend's clean-up
HAND_BACK_BUDGET = 1.2      # seconds for handing waiting creates back at a stop
CLAIM_STALE = 30.0          # a `starting` claim this long past its request's deadline is abandoned
RECORD_RETRY = 8.0          # seconds a state record or event is retried (a leader election takes seconds)
WAIT = -1                   # _claim: another node is starting this request now
ENV_RETRIES = 1             # times a create whose environment failed is placed again on another node
ANNOUNCE_WAIT = 16.0        # a sandbox's records wait this long for its `created` ones (a publish's worst case)


def _decode_record(raw: bytes | None) -> SandboxRecord | None:
    if raw is None:
        return None
    try:
        return sandbox_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


@dataclass
class Running:
    """A sandbox this edge runs."""

    record: SandboxRecord
    expires_at: float
    suspended_since: float = 0.0     # unix time of client.suspend, 0 when running
    suspends: int = 0                # how many times it was suspended (names its events)
    spec: SandboxSpec | None = None  # what the backend was asked to start (a rollback restarts it)
    layers: list[LayerRef] = field(default_factory=list)   # its layers, lowest first
    restarts: int = 0                # rollbacks so far (names their events)
    snapshots: int = 0               # snapshots taken of it (names their events)
    announced: asyncio.Future | None = None   # its `created` records are out (or given up on)

    async def after_created(self) -> None:
        """Wait (bounded) until its `created` records are published: nothing of it goes out before them."""
        fut = self.announced
        if fut is None or fut.done():
            return
        try:
            await asyncio.wait_for(asyncio.shield(fut), ANNOUNCE_WAIT)
        except asyncio.TimeoutError:
            pass
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not fut.cancelled() or (task is not None and task.cancelling()):
                raise   # we were cancelled, not (only) the announcement (cancelled at a stop)


class Edge:
    """One node agent over one backend."""

    def __init__(self, bus: Bus, backend: Backend, config: EdgeConfig, state_dir: Path) -> None:
        self.bus = bus
        self.backend = backend
        self.config = config
        self.node = subjects.token(config.node_id, "node id")
        self.capacity = Capacity(config)
        self.state_dir = Path(state_dir)
        self.layers = LayerCache(bus, self.state_dir / "layer-cache", config.layer_cache, in_use=lambda: {
            la.digest for r in self.sandboxes.values() for la in r.layers} | self.warm.digests(),
            on_change=lambda: self.record.changed())
        self.sandboxes: dict[str, Running] = {}
        self.ops = OpLane(self)
        self.warm = WarmPools(self)
        self.record = NodeRecord(bus, self.capacity, self._set_draining, self._declared_lost,
                                 inventory=lambda: dict(warm=self.warm.stock(), layers=self.layers.held()))
        self._creating: set[str] = set()
        self._claims: set[str] = set()     # ids claimed (`starting`) and not yet ready or failed
        self._slow_way: collections.OrderedDict[str, None] = collections.OrderedDict()   # no warm short way
        self._announcing: set[asyncio.Task] = set()   # `created` records being published
        self._create_worker = None
        self._pool_worker = None
        self._tasks: list[asyncio.Task] = []
        self.created = 0
        self.failed = 0

    # ---- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Reconcile leftovers, report lost sandboxes, heartbeat, then take work."""
        try:
            await self.backend.start()
        except BackendError as exc:
            raise EnvironmentFailure(f"edge {self.node} cannot start: {exc}") from exc
        await self._report_lost()
        # Messages a crashed run of this node had pulled but not acked would wait out the ack wait
        # (30 s) before redelivery; no one else serves this node (its lock), so start the lanes afresh.
        for stream, config in (streams.edge_create_consumer(self.node), streams.edge_ops_consumer(self.node)):
            await self.bus.delete_consumer(stream, config.durable_name)
        await self.record.write()
        self.record.start(self.config.heartbeat)
        self._tasks = [asyncio.create_task(self._ttl_loop())]
        await self.ops.start()
        await self.warm.start()
        self._create_worker = await self.bus.pull_worker(streams.edge_create_consumer(self.node),
                                                         self._on_node_create, credit=self._create_credit)
        # The pool's shared lane (cloud bursting): every edge of the pool competes for it.
        self._pool_worker = await self.bus.pull_worker(streams.pool_create_consumer(self.config.pool),
                                                       self._on_pool_create, credit=self._pool_credit)

    @property
    def creating(self) -> bool:
        """Whether a create is being served now."""
        return bool(self._creating)

    @property
    def draining(self) -> bool:
        """Drained by an operator: takes no new sandbox; the running ones finish."""
        return self.record.draining

    def _set_draining(self, draining: bool) -> None:
        log.info("node %s %s", self.node, "draining" if draining else "accepting work again")
        self._poke()

    def _declared_lost(self) -> None:
        """Placement declared this node lost while it ran (its heartbeats did not land for too long): its
        sandboxes were reported node_lost and its waiting creates placed elsewhere, so the ones it still
        runs are destroyed, as a restart would; then it serves afresh."""
        log.error("node %s was declared lost while running; destroying its %d sandboxes", self.node,
                  len(self.sandboxes))
        for sid in list(self.sandboxes):
            self._tasks.append(asyncio.create_task(self._destroy_quietly(sid, "node_lost",
                                                                         "node was declared lost")))

    async def _destroy_quietly(self, sandbox_id: str, state: str, reason: str) -> None:
        try:
            await self.destroy(sandbox_id, state=state, reason=reason)
        except KeyError:
            pass
        except Exception:
            log.exception("destroy of %s failed", sandbox_id)

    def _poke(self) -> None:
        for w in (self._create_worker, self._pool_worker):
            if w is not None:
                w.poke()

    async def stop(self) -> None:
        """Stop taking work, destroy every sandbox, release the node, hand waiting creates back.

        Order matters under the caller's budget (about 6 s): the node is marked draining (no new
        bookings) and the lanes stop within STOP_BUS_BUDGET; the backend's clean-up comes next, whatever
        happened before; bus bookkeeping and the hand-back come last, each bounded."""
        claims = set(self._claims)   # creates cut short below: their ids are freed at the end
        loop = asyncio.get_running_loop()
        until = loop.time() + STOP_BUS_BUDGET

        async def step(aw) -> None:
            try:
                await asyncio.wait_for(aw, max(0.05, until - loop.time()))
            except asyncio.CancelledError:
                raise
            except Exception as exc:   # whatever the bus does, the stop goes on
                log.info("stop step skipped: %s", exc)

        ids = list(self.sandboxes)
        try:
            from placement.ledger import set_flag
            await step(set_flag(self.bus, self.node, draining=True))
            for w in (self._create_worker, self._pool_worker):
                if w:
                    await step(w.stop(drain=False))
            await step(self.record.stop())
            await step(self.warm.stop())
            await step(self.ops.stop())
            for t in [*self._tasks, *self._announcing]:   # no record waits on an announcement any more
                t.cancel()
            await step(asyncio.gather(*self._tasks, return_exceptions=True))
            ids = list(self.sandboxes)
        finally:
            try:
                await self.backend.stop()
            except BackendError as exc:
                log.error("backend stop incomplete: %s", exc)
        await self._best_effort(self._forget_all(ids))
        await self._best_effort(self._hand_back(claims), HAND_BACK_BUDGET)

    async def _hand_back(self, claims: set[str]) -> None:
        """At a stop, after the node record is gone (nothing books it any more): free the ids of creates
        cut short, and send the creates waiting on this node's lane back to placement."""
        from placement.reaper import replace_creates
        for sid in claims:
            await self._free_claim(sid)
        handed = await replace_creates(self.bus, self.node)
        if handed:
            log.warning("node %s stopping: %d waiting creates handed back to placement", self.node, handed)

    async def _free_claim(self, sandbox_id: str) -> None:
        """Delete this node's `starting` record of an id (compare-and-set: never someone else's)."""
        raw, revision = await self.bus.kv_entry(streams.SANDBOXES_KV, sandbox_id)
        rec = _decode_record(raw)
        if rec is not None and rec.node == self.node and rec.state == "starting":
            await self.bus.kv_cas_delete(streams.SANDBOXES_KV, sandbox_id, revision)

    async def _best_effort(self, coro, budget: float = BUS_CLEANUP_TIMEOUT) -> None:
        try:
            await asyncio.wait_for(coro, budget)
        except asyncio.CancelledError:
            raise
        except Exception as exc:   # whatever the bus does, the stop goes on
            log.info("bus update skipped during cleanup: %s", exc)

    async def _forget_all(self, ids: list[str]) -> None:
        await asyncio.gather(*(self._mark_gone(i, "destroyed", "edge stopped") for i in ids))
        await self.bus.kv_delete(streams.NODES_KV, self.node)

    async def _report_lost(self) -> None:
        """Sandboxes KV says run here, but the reconcile just removed: node_lost, never silently leaked."""
        for key, raw in await self.bus.kv_items(streams.SANDBOXES_KV):
            try:
                rec = sandbox_decoder.decode(raw)
            except msgspec.DecodeError:
                continue
            if rec.node == self.node and rec.state == "ready":
                self.sandboxes[key] = Running(rec, 0)
                await self._mark_gone(key, "node_lost", "edge restarted; sandbox destroyed by reconcile")
            elif rec.node == self.node and rec.state == "starting":   # a crashed run's claim: free the id
                await self._free_claim(key)

    # ---- accounting and heartbeat ---------------------------------------------------------------

    def _create_credit(self) -> int:
        """Create messages this edge may hold: free slots, plus those in flight that already booked one.
        A draining node still takes what its lane holds: placement booked those before the drain."""
        return self.capacity.free_slots() + sum(1 for i in self._creating if i in self.capacity.used)

    def _pool_credit(self) -> int:
        """The pool's shared lane: nothing while draining."""
        return 0 if self.draining else self._create_credit()

    async def _ttl_loop(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            now = time.time()
            for sid in [s for s, r in self.sandboxes.items()
                        if r.expires_at and r.expires_at < now and not r.suspended_since]:   # TTL paused
                try:
                    await self.destroy(sid, state="expired", reason="ttl reached")
                except KeyError:
                    pass    # destroyed by a request meanwhile
                except Exception:   # never let one failure end TTL enforcement for the node
                    log.exception("ttl destroy of %s failed", sid)

    # ---- create lane --------------------------------------------------------------------------

    async def _reply(self, reply_to: str, msg) -> None:
        if subjects.is_reply_subject(reply_to):
            with contextlib.suppress(DsecError):
                await self.bus.send(reply_to, msg)

    async def _on_node_create(self, d: Delivery) -> Verdict:
        return await self._on_create(d, streams.ACK_WAIT / 3)

    async def _on_pool_create(self, d: Delivery) -> Verdict:
        if self.draining:   # a drained node takes nothing new from its pool; what was booked on it still runs
            d.nak_delay = 0.5
            return Verdict.NAK
        return await self._on_create(d, streams.POOL_ACK_WAIT / 3)

    async def _on_create(self, d: Delivery, lease_every: float) -> Verdict:
        try:
            req = create_decoder.decode(d.data)
            subjects.token(req.sandbox_id, "sandbox_id"), subjects.token(req.tenant, "tenant")
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            env = salvage(d.data)
            await self._reply(env.reply_to, ErrorReply(request_id=env.request_id, code=InvalidRequest.code,
                                                       message=f"bad create request: {exc}"))
            return Verdict.TERM
        if req.sandbox_id in self._creating:
            return Verdict.ACK   # a redelivery while the first delivery still works: that one answers
        try:   # this lane is open to any publisher, not only placement: check again, never wait forever
            admission.check_create(req)
            if not self.capacity.could_ever_fit(req.resources):
                raise CapacityUnavailable(f"node {self.node} can never fit these resources")
        except DsecError as err:
            await self._reply(req.reply_to, ErrorReply(request_id=req.request_id, code=err.code, message=str(err)))
            return self._answered(req)
        running = self.sandboxes.get(req.sandbox_id)
        if running is not None:   # served before (ack lost): answer again; another request: refuse
            same = running.record.request_id == req.request_id
            await self._reply(req.reply_to, SandboxReady(request_id=req.request_id, sandbox_id=req.sandbox_id,
                                                         node=self.node) if same else ErrorReply(
                request_id=req.request_id, code=InvalidRequest.code, message="sandbox_id is already in use"))
            return self._answered(req)
        expired = time.time() > req.deadline
        if not expired and not self.capacity.fits(req.resources):
            d.nak_delay = 0.2    # room may free before its deadline; until then it waits in JetStream
            return Verdict.NAK
        if not expired:   # booked before any await: two deliveries can never share one slot; the booking
            self.capacity.reserve(req.sandbox_id, req.resources)   # leaves the record as the usage enters it
            self.record.took(req.request_id)
        self._creating.add(req.sandbox_id)
        lease = Lease(d, every=lease_every)   # a third of the lane's ack wait: never redelivered while it runs
        verdict = Verdict.NAK
        try:
            verdict = await self._create(req)
        except (BusError, EnvironmentFailure) as exc:   # before anything started: try again shortly
            log.warning("create %s retried: %s", req.request_id, exc)
        finally:
            lease.cancel()
            self._creating.discard(req.sandbox_id)
            if req.sandbox_id not in self.sandboxes:   # not started here (answered, failed, retried later)
                self.capacity.release(req.sandbox_id)
                self.record.changed()
        d.nak_delay = 0.5
        return verdict

    def _answered(self, req: CreateRequest) -> Verdict:
        """The request got its answer here: its booking on this node is no longer needed."""
        self.record.took(req.request_id)
        return Verdict.ACK

    async def _create(self, req: CreateRequest) -> Verdict:
        """Claim, start, record, answer. NAK when another node is still starting it (ask again later)."""
        if await self._create_warm(req):
            return Verdict.ACK
        revision = await self._claim(req)
        if revision == WAIT:
            return Verdict.NAK
        if revision is None:
            return self._answered(req)
        self._claims.add(req.sandbox_id)
        try:
            return await self._start_claimed(req, revision)
        finally:
            self._claims.discard(req.sandbox_id)

    async def _start_claimed(self, req: CreateRequest, revision: int) -> Verdict:
        try:
            if time.time() > req.deadline:
                raise RequestExpired("create request expired before a node started it")
            spec = await self._start_sandbox(req)
        except DsecError as err:
            self.capacity.release(req.sandbox_id)
            self.record.changed()
            self.failed += 1
            if isinstance(err, EnvironmentFailure) and len(req.avoid) < ENV_RETRIES and time.time() < req.deadline:
                try:
                    self.record.took(req.request_id)   # its booking here goes first
                    await self._retry_elsewhere(req, err)
                    return Verdict.ACK
                except DsecError as exc:
                    log.warning("create %s not placed again: %s", req.request_id, exc)
            await self._record_failure(req, err)
            return Verdict.ACK
        rec = self._ready_record(req)
        if not await self._record_ready(rec, revision):   # our claim was taken from us (declared lost)
            await self._drop(req)
            return Verdict.ACK
        await self._started(req, spec, rec)
        return Verdict.ACK

    def _ready_record(self, req: CreateRequest) -> SandboxRecord:
        now = time.time()
        return SandboxRecord(sandbox_id=req.sandbox_id, tenant=req.tenant, node=self.node, state="ready",
                             image=req.image, labels=dict(req.labels), resources=req.resources, created_at=now,
                             expires_at=now + req.ttl, updated_at=now, request_id=req.request_id,
                             layers=[layer.digest for layer in req.layers])

    async def _create_warm(self, req: CreateRequest) -> bool:
        """The short way for a create a warm sandbox matches: claim it, then record the id `ready` with one
        create-only write (no `starting` step: the sandbox is ready already). False when there is no warm
        sandbox or the id has another record already (the sandbox is destroyed, and the usual way, which
        this request then always takes, answers)."""
        if time.time() > req.deadline or req.request_id in self._slow_way:
            return False
        warm = self.warm.take(req.layers, req.resources, req.request_id)
        if warm is None:
            return False
        try:
            paths = await self.layers.ensure(req.layers)   # held by the pool: no fetch
        except Exception:   # the usual way meets it again and makes it a typed failure
            self.warm.retire(warm)
            return False
        spec = SandboxSpec(id=req.sandbox_id, layers=paths, env=dict(req.env), limits=limits(req.resources))
        if not await self._claim_warm(req, spec, warm):
            return False
        rec = self._ready_record(req)
        if not await self._record_ready(rec):   # the id has a record already
            self._slow_way[req.request_id] = None
            while len(self._slow_way) > 1024:
                self._slow_way.popitem(last=False)
            with contextlib.suppress(BackendError):
                await self.backend.destroy(req.sandbox_id)
            return False
        await self._started(req, spec, rec)
        return True

    async def _started(self, req: CreateRequest, spec: SandboxSpec, rec: SandboxRecord) -> None:
        """A sandbox runs and its record says `ready`: keep it, answer the client, announce it."""
        now = rec.created_at
        running = Running(rec, now + req.ttl, spec=spec, layers=list(req.layers))
        self.sandboxes[req.sandbox_id] = running
        self.created += 1
        # The reply does not wait for the `created` records: the sandbox's later records (exec, destroyed)
        # wait for them instead (Running.after_created), so the timeline keeps its order.
        running.announced = asyncio.ensure_future(self._announce(rec, req.request_id))
        self._announcing.add(running.announced)
        running.announced.add_done_callback(self._announcing.discard)
        await self._reply(req.reply_to, SandboxReady(request_id=req.request_id, sandbox_id=req.sandbox_id,
                                                     node=self.node))

    async def _announce(self, rec: SandboxRecord, request_id: str) -> None:
        try:
            await self._event(rec, "created", request_id)
        except BusError as exc:
            log.error("created event of %s not published: %s", rec.sandbox_id, exc)
        except Exception:   # never into the records that wait for it
            log.exception("created event of %s not published", rec.sandbox_id)

    async def _record_ready(self, rec: SandboxRecord, claim: int = 0) -> bool:
        """Write our sandbox's `ready` record by compare-and-set on `claim`: our `starting` claim's revision,
        or 0 for an id with no record (a warm claim; a deleted record, or this node's own claim from an
        earlier delivery of the request, is written over a few times at most). False when the record is
        no longer ours. Kept trying through a stream leader moving to another server; a retried write
        that landed the first time reads back as ours."""
        give_up, revision, conflicts = time.monotonic() + RECORD_RETRY, claim, 0
        while True:
            try:
                if await self.bus.kv_cas(streams.SANDBOXES_KV, rec.sandbox_id, encode(rec), revision) is not None:
                    return True
                raw, latest = await self.bus.kv_entry(streams.SANDBOXES_KV, rec.sandbox_id)
                prior = _decode_record(raw)
                ours = prior is not None and prior.node == self.node and prior.request_id == rec.request_id
                if not claim and conflicts < 4 and (raw is None or (ours and prior.state == "starting")):
                    revision, conflicts = latest, conflicts + 1
                    continue
                return ours and prior.state == "ready"
            except BusError as exc:
                if time.monotonic() > give_up:
                    log.error("state of %s not recorded: %s", rec.sandbox_id, exc)
                    return True   # it runs and the client is told; the record catches up on destroy
                await asyncio.sleep(0.2)

    async def _drop(self, req: CreateRequest) -> None:
        """A sandbox started under a claim that was taken away: destroy it, answer from the record if any."""
        log.warning("claim of %s lost while starting it; destroying it here", req.sandbox_id)
        try:
            await self.backend.destroy(req.sandbox_id)
        except BackendError as exc:
            log.error("destroying %s failed: %s", req.sandbox_id, exc)
        self.capacity.release(req.sandbox_id)
        self.record.changed()
        raw, _ = await self.bus.kv_entry(streams.SANDBOXES_KV, req.sandbox_id)
        prior = _decode_record(raw)
        if prior is not None and prior.state != "starting":
            await self._answer_from(req, prior)
        # no record: the reaper placed the request again, and its new node answers

    async def _claim(self, req: CreateRequest) -> int | None:
        """Claim the sandbox id for this request by compare-and-set on its KV record (state `starting`).

        The record is the one place that decides: a request redelivered, placed twice (JetStream's
        duplicate window does not survive a stream leader change for messages already consumed), or
        sent again by a client starts at most one sandbox, on the node that claimed it. Anyone else
        answers from the record. Returns the claim's revision; None when the request was answered
        from the record; WAIT while another node is starting it."""
        now = time.time()
        mine = encode(SandboxRecord(sandbox_id=req.sandbox_id, tenant=req.tenant, node=self.node, state="starting",
                                    image=req.image, labels=dict(req.labels), resources=req.resources,
                                    created_at=now, updated_at=now, request_id=req.request_id))
        revision = 0
        for _ in range(4):
            claimed = await self.bus.kv_cas(streams.SANDBOXES_KV, req.sandbox_id, mine, revision)
            if claimed is not None:
                return claimed
            raw, revision = await self.bus.kv_entry(streams.SANDBOXES_KV, req.sandbox_id)
            prior = _decode_record(raw)   # junk under this key names no sandbox: claim over it
            if prior is None or (prior.node == self.node and prior.state == "starting"
                                 and prior.request_id == req.request_id):
                continue   # free, or a claim of a crashed run of this node: take it over
            if prior.state == "starting" and prior.request_id == req.request_id:
                if await self._abandoned(prior, req):
                    continue   # its node is gone, restarted or far past the deadline: take it over
                return WAIT   # another node starts it now: it answers; if it dies, the reaper frees the id
            await self._answer_from(req, prior)
            return None
        raise EnvironmentFailure(f"could not claim sandbox {req.sandbox_id}: its record keeps changing")

    async def _abandoned(self, claim: SandboxRecord, req: CreateRequest) -> bool:
        """Whether another node's `starting` claim will never be finished: its node has no record, is
        lost, restarted since it claimed, or the request's deadline passed long ago."""
        if time.time() > req.deadline + CLAIM_STALE:
            return True
        from placement.ledger import decode_node
        owner = decode_node(claim.node, await self.bus.kv_get(streams.NODES_KV, claim.node))
        return owner is None or owner.lost or owner.started_at > claim.created_at

    async def _answer_from(self, req: CreateRequest, prior: SandboxRecord) -> None:
        """Answer a create whose sandbox id already has a final record (or is in use by another request)."""
        if prior.request_id != req.request_id:
            await self._reply(req.reply_to, ErrorReply(request_id=req.request_id, code=InvalidRequest.code,
                                                       message="sandbox_id is already in use"))
        elif prior.state == "ready":   # served, maybe by another node: point the client there
            await self._reply(req.reply_to, SandboxReady(request_id=req.request_id, sandbox_id=req.sandbox_id,
                                                         node=prior.node))
        else:   # its outcome was recorded; the reply may have died with a crash
            await self._reply(req.reply_to, ErrorReply(
                request_id=req.request_id, code=SandboxNotFound.code, reason=prior.state,
                message=f"sandbox {req.sandbox_id} {prior.state}: {prior.reason}"))

    async def _start_sandbox(self, req: CreateRequest) -> SandboxSpec:
        """Fetch layers and start the backend sandbox; every failure becomes a typed DsecError."""
        try:
            paths = await self.layers.ensure(req.layers)
            spec = SandboxSpec(id=req.sandbox_id, layers=paths, env=dict(req.env), limits=limits(req.resources))
            if not await self._claim_warm(req, spec):
                await self.backend.create(spec)
        except DsecError:
            raise
        except LayerUnusable as exc:   # a cached layer that does not mount: fetched (and verified) again next time
            self.layers.evict(req.layers)
            raise EnvironmentFailure(f"sandbox could not start on {self.node}: {exc}") from exc
        except Exception as exc:   # BackendError, OSError writing the layer cache, ...
            raise EnvironmentFailure(f"sandbox could not start on {self.node}: {exc}") from exc
        if time.time() > req.deadline:   # the client gave up meanwhile: never leave an orphan
            try:
                await self.backend.destroy(req.sandbox_id)
            except BackendError as exc:
                log.error("destroying expired sandbox %s failed: %s", req.sandbox_id, exc)
            raise RequestExpired("create request expired while the sandbox started; it was destroyed")
        return spec

    async def _claim_warm(self, req: CreateRequest, spec: SandboxSpec, warm: str | None = None) -> bool:
        """Give the create a ready sandbox of a matching warm pool (this one, or one taken now)."""
        warm = warm or self.warm.take(req.layers, req.resources, req.request_id)
        if warm is None:
            return False
        try:
            await self.backend.claim(warm, spec)
            return True
        except (BackendError, OSError) as exc:   # e.g. its init died: start one cold instead
            log.warning("warm sandbox %s not claimed for %s (%s): starting one cold", warm, req.sandbox_id, exc)
            self.warm.retire(warm)
            return False

    async def _retry_elsewhere(self, req: CreateRequest, err: EnvironmentFailure) -> None:
        """An environment failure (a layer, a mount, the launch) on this node: free the id and send the
        create back to placement with this node to avoid; the client's reply comes from where it runs."""
        await self._free_claim(req.sandbox_id)
        again = msgspec.structs.replace(req, node="", pool="", attempt=req.attempt + 1,
                                        avoid=[*req.avoid, self.node])
        rec = SandboxRecord(sandbox_id=req.sandbox_id, tenant=req.tenant, node=self.node, state="failed",
                            image=req.image, labels=dict(req.labels), request_id=req.request_id)
        with contextlib.suppress(DsecError):   # first: the next attempt's events come after it
            await self._event(rec, "retried", req.request_id, f"placed again elsewhere after: {err}",
                              nth=again.attempt, failure_class="environment")
        await self.bus.publish(subjects.create_request(req.tenant, req.priority), encode(again),
                               msg_id=f"{req.request_id}.{again.attempt}", retries=3, retry_for=5.0)

    async def _record_failure(self, req: CreateRequest, err: DsecError) -> None:
        state = "expired" if isinstance(err, RequestExpired) else "failed"
        now = time.time()
        rec = SandboxRecord(sandbox_id=req.sandbox_id, tenant=req.tenant, node=self.node, state=state,
                            image=req.image, labels=dict(req.labels), resources=req.resources, created_at=now,
                            updated_at=now, reason=str(err), request_id=req.request_id)
        with contextlib.suppress(DsecError):
            await asyncio.gather(self.bus.kv_put(streams.SANDBOXES_KV, req.sandbox_id, rec, retry_for=RECORD_RETRY),
                                 self._event(rec, state, req.request_id, str(err), failure_class=(
                                     "environment" if isinstance(err, EnvironmentFailure) else "")))
        await self._reply(req.reply_to, ErrorReply(request_id=req.request_id, code=err.code, message=str(err)))

    async def _event(self, rec: SandboxRecord, type_: str, request_id: str = "", detail: str = "",
                     nth: int = 0, failure_class: str = "") -> None:
        """A lifecycle event, on the ops event stream and on the sandbox's trajectory timeline (nth: which
        one of a step that may happen again, e.g. the 2nd suspend)."""
        running = self.sandboxes.get(rec.sandbox_id)
        if running is not None and type_ != "created":
            await running.after_created()
        now = time.time()
        ev = Event(type=type_, sandbox_id=rec.sandbox_id, tenant=rec.tenant, node=self.node,
                   request_id=request_id, at=now, detail=detail, failure_class=failure_class)
        job = subjects.job_of(rec.labels)
        name = f"{type_}.{nth}" if nth else type_
        traj = TrajRecord(id=f"{rec.sandbox_id}.{name}", type=type_, sandbox_id=rec.sandbox_id, tenant=rec.tenant,
                          job=job, node=self.node, at=now, detail=detail, failure_class=failure_class)
        await asyncio.gather(
            self.bus.publish(subjects.event(rec.tenant, rec.sandbox_id), encode(ev),
                             msg_id=f"{rec.sandbox_id}.{name}.{self.node}", retry_for=RECORD_RETRY),
            self.bus.publish(subjects.trajectory(rec.tenant, job, rec.sandbox_id), encode(traj),
                             msg_id=f"{rec.sandbox_id}.{name}.{self.node}.traj", retry_for=RECORD_RETRY))

    # ---- suspend and resume (client.suspend / client.resume) -----------------------------------

    async def suspend(self, sandbox_id: str) -> None:
        """Freeze a sandbox; its TTL stops counting. Idempotent."""
        running = self.sandboxes[sandbox_id]
        if running.suspended_since:
            return
        await self.backend.freeze(sandbox_id)
        now = time.time()
        running.suspended_since, running.suspends = now, running.suspends + 1
        running.record = msgspec.structs.replace(running.record, suspended=True, suspended_at=now, updated_at=now)
        await asyncio.gather(self._write_record(sandbox_id, running.record),
                             self._event(running.record, "suspended", nth=running.suspends))

    async def resume(self, sandbox_id: str) -> None:
        """Thaw a suspended sandbox; its TTL moves on by the time it was suspended. Idempotent."""
        running = self.sandboxes[sandbox_id]
        if not running.suspended_since:
            return
        await self.backend.thaw(sandbox_id)
        now = time.time()
        if running.expires_at:
            running.expires_at += now - running.suspended_since
        running.suspended_since = 0.0
        running.record = msgspec.structs.replace(running.record, suspended=False, updated_at=now,
                                                 expires_at=running.expires_at or running.record.expires_at)
        await asyncio.gather(self._write_record(sandbox_id, running.record),
                             self._event(running.record, "resumed", nth=running.suspends))

    # ---- snapshots and rollback ------------------------------------------------------------------

    async def snapshot(self, sandbox_id: str, tag: str) -> SnapshotRecord:
        """Pack the writable layer (processes frozen meanwhile) as a layer over the sandbox's own, store
        it (object store, by digest) and its record (KV dsec-snapshots)."""
        running = self.sandboxes[sandbox_id]
        snap_id = "snap" + secrets.token_hex(8)
        with tempfile.TemporaryDirectory(dir=self.state_dir) as tmp:
            layer_file = Path(tmp) / "snapshot.erofs"
            digest = await self.backend.pack_upper(sandbox_id, str(layer_file))
            size = layer_file.stat().st_size
            if not await self.bus.obj_has(streams.LAYERS_OBJ, digest):
                data = await asyncio.to_thread(layer_file.read_bytes)
                await self.bus.obj_put(streams.LAYERS_OBJ, digest, data)
            own = LayerRef(name=f"snapshot-{snap_id}", version=1, digest=digest, size=size)
            self.layers.adopt(own, layer_file)   # forks and rollbacks here need no fetch
        rec = running.record
        snap = SnapshotRecord(id=snap_id, tag=tag, tenant=rec.tenant, sandbox_id=sandbox_id,
                              layers=[*running.layers, own],
                              image=rec.image, env=dict(running.spec.env) if running.spec else {},
                              resources=rec.resources, labels=dict(rec.labels), size=size, created_at=time.time())
        await self.bus.kv_put(streams.SNAPSHOTS_KV, snap_id, snap, retry_for=RECORD_RETRY)
        running.snapshots += 1
        with contextlib.suppress(DsecError):
            await self._event(rec, "snapshot", detail=f"{snap_id} {tag}".strip(), nth=running.snapshots)
        return snap

    async def rollback(self, sandbox_id: str, snap: SnapshotRecord) -> None:
        """Restart the sandbox on the snapshot's layers with a fresh writable layer (same id, node,
        resources; its processes start afresh). If the restart fails the sandbox is gone (failed)."""
        running = self.sandboxes[sandbox_id]
        assert running.spec is not None
        paths = await self.layers.ensure(snap.layers)          # before anything is torn down
        spec = SandboxSpec(id=sandbox_id, layers=paths, env=dict(running.spec.env), limits=running.spec.limits)
        await self.backend.destroy(sandbox_id)
        try:
            await self.backend.create(spec)
        except Exception as exc:
            await self._mark_gone(sandbox_id, "failed", f"rollback to {snap.id} failed: {exc}")
            raise EnvironmentFailure(f"rollback of {sandbox_id} to {snap.id} failed: {exc}") from exc
        running.spec, running.layers, running.restarts = spec, list(snap.layers), running.restarts + 1
        running.suspended_since = 0.0
        running.record = msgspec.structs.replace(running.record, layers=[layer.digest for layer in snap.layers],
                                                 suspended=False, updated_at=time.time())
        await asyncio.gather(self._write_record(sandbox_id, running.record),
                             self._event(running.record, "rollback", detail=snap.id, nth=running.restarts))

    async def _write_record(self, sandbox_id: str, rec: SandboxRecord) -> None:
        """Write our sandbox's KV record, never over one another node wrote since; retried through a
        stream leader moving to another server."""
        mine = rec

        def mutate(raw: bytes | None) -> bytes | None:
            prior = _decode_record(raw)
            if prior is not None and (prior.node != mine.node or prior.request_id != mine.request_id):
                return None
            if prior is not None and prior.state not in ("starting", "ready") and rec.state == "ready":
                return None   # a suspend/resume that lost the race with its destroy: the end stays
            return encode(rec)

        give_up = time.monotonic() + RECORD_RETRY
        while True:
            try:
                await self.bus.kv_update(streams.SANDBOXES_KV, sandbox_id, mutate)
                return
            except BusError:
                if time.monotonic() > give_up:
                    raise
                await asyncio.sleep(0.2)

    # ---- destroy (used by the op lane, the TTL loop and stop) ----------------------------------

    async def destroy(self, sandbox_id: str, state: str = "destroyed", reason: str = "") -> None:
        """Destroy a sandbox this edge runs and record why."""
        if sandbox_id not in self.sandboxes:
            raise KeyError(sandbox_id)
        try:
            await self.backend.destroy(sandbox_id)
        finally:
            await self.ops.settle(sandbox_id)   # its execs' records first, then `destroyed`
            await self._mark_gone(sandbox_id, state, reason)

    async def _mark_gone(self, sandbox_id: str, state: str, reason: str) -> None:
        running = self.sandboxes.pop(sandbox_id, None)
        self.capacity.release(sandbox_id)
        self.record.changed()
        self._poke()
        if running is None:
            return
        await running.after_created()
        rec = msgspec.structs.replace(running.record, state=state, reason=reason, updated_at=time.time(),
                                      suspended=False)
        try:
            await asyncio.gather(self._write_record(sandbox_id, rec), self._event(rec, state, detail=reason))
        except BusError as exc:
            log.warning("state of %s not recorded: %s", sandbox_id, exc)
