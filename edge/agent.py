"""The edge: a node agent. Pulls its own create lane (only as many as it has room for) and op lane."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from bus import streams, subjects
from bus.conn import Bus
from bus.errors import (BusError, CapacityUnavailable, DsecError, EnvironmentFailure, InvalidRequest,
                        RequestExpired, SandboxNotFound)
from bus.messages import (CreateRequest, ErrorReply, Event, SandboxReady, SandboxRecord, create_decoder,
                          encode, salvage, sandbox_decoder)
from bus.pull import Delivery, Lease, Verdict
from edge.backends.base import Backend, BackendError, Limits, SandboxSpec
from edge.capacity import Capacity, EdgeConfig
from edge.layercache import LayerCache
from edge.noderecord import NodeRecord
from edge.ops import OpLane
from placement import admission

log = logging.getLogger(__name__)

BUS_CLEANUP_TIMEOUT = 1.0   # cleanup never waits on the bus longer than this
RECORD_RETRY = 8.0          # seconds a state record or event is retried (a leader election takes seconds)


@dataclass
class Running:
    """A sandbox this edge runs."""

    record: SandboxRecord
    expires_at: float


class Edge:
    """One node agent over one backend."""

    def __init__(self, bus: Bus, backend: Backend, config: EdgeConfig, state_dir: Path) -> None:
        self.bus = bus
        self.backend = backend
        self.config = config
        self.node = subjects.token(config.node_id, "node id")
        self.capacity = Capacity(config)
        self.layers = LayerCache(bus, Path(state_dir) / "layer-cache")
        self.sandboxes: dict[str, Running] = {}
        self.ops = OpLane(self)
        self.record = NodeRecord(bus, self.capacity, self._set_draining)
        self._creating: set[str] = set()
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
        self._create_worker = await self.bus.pull_worker(streams.edge_create_consumer(self.node),
                                                         self._on_create, credit=self._create_credit)
        # The pool's shared lane (cloud bursting): every edge of the pool competes for it.
        self._pool_worker = await self.bus.pull_worker(streams.pool_create_consumer(self.config.pool),
                                                       self._on_create, credit=self._create_credit)

    @property
    def draining(self) -> bool:
        """Drained by an operator: takes no new sandbox; the running ones finish."""
        return self.record.draining

    def _set_draining(self, draining: bool) -> None:
        log.warning("node %s %s", self.node, "draining" if draining else "accepting work again")
        self._poke()

    def _poke(self) -> None:
        for w in (self._create_worker, self._pool_worker):
            if w is not None:
                w.poke()

    async def stop(self) -> None:
        """Stop taking work, destroy every sandbox, release the node. Never waits long on the bus."""
        for w in (self._create_worker, self._pool_worker):
            if w:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(w.stop(drain=False), BUS_CLEANUP_TIMEOUT)
        await self.record.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ops.stop(), BUS_CLEANUP_TIMEOUT)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        ids = list(self.sandboxes)
        try:
            await self.backend.stop()
        except BackendError as exc:
            log.error("backend stop incomplete: %s", exc)
        await self._best_effort(self._forget_all(ids))

    async def _best_effort(self, coro) -> None:
        try:
            await asyncio.wait_for(coro, BUS_CLEANUP_TIMEOUT)
        except (asyncio.TimeoutError, DsecError) as exc:
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

    # ---- accounting and heartbeat ---------------------------------------------------------------

    def _create_credit(self) -> int:
        """Create messages this edge may hold: free slots, plus those in flight that already booked one."""
        if self.draining:
            return 0
        return self.capacity.free_slots() + sum(1 for i in self._creating if i in self.capacity.used)

    async def _ttl_loop(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            now = time.time()
            for sid in [s for s, r in self.sandboxes.items() if r.expires_at and r.expires_at < now]:
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

    async def _on_create(self, d: Delivery) -> Verdict:
        verdict, request_id = await self._take_create(d)
        if verdict is not Verdict.NAK and request_id:
            self.record.took(request_id)   # answered one way or another: its booking is no longer needed
        return verdict

    async def _take_create(self, d: Delivery) -> tuple[Verdict, str]:
        verdict = await self._create_lane(d)
        try:
            return verdict, create_decoder.decode(d.data).request_id
        except (msgspec.DecodeError, msgspec.ValidationError):
            return verdict, ""

    async def _create_lane(self, d: Delivery) -> Verdict:
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
            return Verdict.ACK
        if time.time() > req.deadline and req.sandbox_id not in self.sandboxes:
            await self._create(req)   # records and answers `expired`; never starts it
            return Verdict.ACK
        running = self.sandboxes.get(req.sandbox_id)
        if running is not None:   # served before (ack lost): answer again; another request: refuse
            same = running.record.request_id == req.request_id
            await self._reply(req.reply_to, SandboxReady(request_id=req.request_id, sandbox_id=req.sandbox_id,
                                                         node=self.node) if same else ErrorReply(
                request_id=req.request_id, code=InvalidRequest.code, message="sandbox_id is already in use"))
            return Verdict.ACK
        if not self.capacity.fits(req.resources):
            d.nak_delay = 0.2    # room may free before its deadline; until then it waits in JetStream
            return Verdict.NAK
        self._creating.add(req.sandbox_id)
        lease = Lease(d)
        try:
            await self._create(req)
        except BusError as exc:   # the bus hiccuped before anything started: try again shortly
            log.warning("create %s retried: %s", req.request_id, exc)
            d.nak_delay = 0.5
            return Verdict.NAK
        finally:
            lease.cancel()
            self._creating.discard(req.sandbox_id)
        return Verdict.ACK

    async def _create(self, req: CreateRequest) -> None:
        if not await self._claim(req):   # a BusError here leaves the request for redelivery
            return
        try:
            if time.time() > req.deadline:
                raise RequestExpired("create request expired before a node started it")
            self.capacity.reserve(req.sandbox_id, req.resources)
            self.record.took(req.request_id)
            await self._start_sandbox(req)
        except DsecError as err:
            self.capacity.release(req.sandbox_id)
            self.record.changed()
            self.failed += 1
            await self._record_failure(req, err)
            return
        now = time.time()
        rec = SandboxRecord(sandbox_id=req.sandbox_id, tenant=req.tenant, node=self.node, state="ready",
                            image=req.image, labels=dict(req.labels), resources=req.resources, created_at=now,
                            expires_at=now + req.ttl, updated_at=now, request_id=req.request_id)
        self.sandboxes[req.sandbox_id] = Running(rec, now + req.ttl)
        self.created += 1
        try:   # kept trying through a stream leader moving to another server
            await asyncio.gather(self.bus.kv_put(streams.SANDBOXES_KV, req.sandbox_id, rec, retry_for=RECORD_RETRY),
                                 self._event(rec, "created", req.request_id))
        except BusError as exc:
            log.error("state of %s not recorded: %s", req.sandbox_id, exc)
        await self._reply(req.reply_to, SandboxReady(request_id=req.request_id, sandbox_id=req.sandbox_id,
                                                     node=self.node))

    async def _claim(self, req: CreateRequest) -> bool:
        """Claim the sandbox id for this request by compare-and-set on its KV record (state `starting`).

        The record is the one place that decides: a request redelivered, placed twice (JetStream's
        duplicate window does not survive a stream leader change for messages already consumed), or
        sent again by a client starts at most one sandbox, on the node that claimed it. Anyone else
        answers from the record. False when the request is answered (or being served) elsewhere."""
        now = time.time()
        mine = encode(SandboxRecord(sandbox_id=req.sandbox_id, tenant=req.tenant, node=self.node, state="starting",
                                    image=req.image, labels=dict(req.labels), resources=req.resources,
                                    created_at=now, updated_at=now, request_id=req.request_id))
        revision = 0
        for _ in range(4):
            if await self.bus.kv_cas(streams.SANDBOXES_KV, req.sandbox_id, mine, revision) is not None:
                return True
            raw, revision = await self.bus.kv_entry(streams.SANDBOXES_KV, req.sandbox_id)
            prior = None
            if raw is not None:
                try:
                    prior = sandbox_decoder.decode(raw)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    prior = None   # junk under this key names no sandbox: claim over it
            if prior is None or (prior.node == self.node and prior.state == "starting"
                                 and prior.request_id == req.request_id):
                continue   # free, or a claim of a crashed run of this node: take it over
            await self._answer_from(req, prior)
            return False
        raise EnvironmentFailure(f"could not claim sandbox {req.sandbox_id}: its record keeps changing")

    async def _answer_from(self, req: CreateRequest, prior: SandboxRecord) -> None:
        """Answer a create whose sandbox id already has a record (then it was, or is being, served)."""
        if prior.request_id != req.request_id:
            await self._reply(req.reply_to, ErrorReply(request_id=req.request_id, code=InvalidRequest.code,
                                                       message="sandbox_id is already in use"))
        elif prior.state == "ready":   # served, maybe by another node: point the client there
            await self._reply(req.reply_to, SandboxReady(request_id=req.request_id, sandbox_id=req.sandbox_id,
                                                         node=prior.node))
        elif prior.state != "starting":   # its outcome was recorded; the reply may have died with a crash
            await self._reply(req.reply_to, ErrorReply(
                request_id=req.request_id, code=SandboxNotFound.code, reason=prior.state,
                message=f"sandbox {req.sandbox_id} {prior.state}: {prior.reason}"))
        # starting elsewhere: that node answers

    async def _start_sandbox(self, req: CreateRequest) -> None:
        """Fetch layers and start the backend sandbox; every failure becomes a typed DsecError."""
        try:
            paths = await self.layers.ensure(req.layers)
            r = req.resources
            spec = SandboxSpec(id=req.sandbox_id, layers=paths, env=dict(req.env),
                               limits=Limits(cpu=r.cpu, memory=r.memory, pids=r.pids, disk=r.disk))
            await self.backend.create(spec)
        except DsecError:
            raise
        except Exception as exc:   # BackendError, OSError writing the layer cache, ...
            raise EnvironmentFailure(f"sandbox could not start on {self.node}: {exc}") from exc
        if time.time() > req.deadline:   # the client gave up meanwhile: never leave an orphan
            try:
                await self.backend.destroy(req.sandbox_id)
            except BackendError as exc:
                log.error("destroying expired sandbox %s failed: %s", req.sandbox_id, exc)
            raise RequestExpired("create request expired while the sandbox started; it was destroyed")

    async def _record_failure(self, req: CreateRequest, err: DsecError) -> None:
        state = "expired" if isinstance(err, RequestExpired) else "failed"
        now = time.time()
        rec = SandboxRecord(sandbox_id=req.sandbox_id, tenant=req.tenant, node=self.node, state=state,
                            image=req.image, labels=dict(req.labels), resources=req.resources, created_at=now,
                            updated_at=now, reason=str(err), request_id=req.request_id)
        with contextlib.suppress(DsecError):
            await asyncio.gather(self.bus.kv_put(streams.SANDBOXES_KV, req.sandbox_id, rec, retry_for=RECORD_RETRY),
                                 self._event(rec, state, req.request_id, str(err)))
        await self._reply(req.reply_to, ErrorReply(request_id=req.request_id, code=err.code, message=str(err)))

    async def _event(self, rec: SandboxRecord, type_: str, request_id: str = "", detail: str = "") -> None:
        ev = Event(type=type_, sandbox_id=rec.sandbox_id, tenant=rec.tenant, node=self.node,
                   request_id=request_id, at=time.time(), detail=detail)
        await self.bus.publish(subjects.event(rec.tenant, rec.sandbox_id), encode(ev),
                               msg_id=f"{rec.sandbox_id}.{type_}", retry_for=RECORD_RETRY)

    # ---- destroy (used by the op lane, the TTL loop and stop) ----------------------------------

    async def destroy(self, sandbox_id: str, state: str = "destroyed", reason: str = "") -> None:
        """Destroy a sandbox this edge runs and record why."""
        if sandbox_id not in self.sandboxes:
            raise KeyError(sandbox_id)
        try:
            await self.backend.destroy(sandbox_id)
        finally:
            await self._mark_gone(sandbox_id, state, reason)

    async def _mark_gone(self, sandbox_id: str, state: str, reason: str) -> None:
        running = self.sandboxes.pop(sandbox_id, None)
        self.capacity.release(sandbox_id)
        self.record.changed()
        self._poke()
        if running is None:
            return
        rec = msgspec.structs.replace(running.record, state=state, reason=reason, updated_at=time.time())
        try:
            await asyncio.gather(self.bus.kv_put(streams.SANDBOXES_KV, sandbox_id, rec, retry_for=RECORD_RETRY),
                                 self._event(rec, state, detail=reason))
        except BusError as exc:
            log.warning("state of %s not recorded: %s", sandbox_id, exc)
