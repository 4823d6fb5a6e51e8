"""An edge's create lanes: its own (dsec.node.<node>.create) and its pool's shared one.

A create is taken only when the node has room for it (credit: free slots), claimed by compare-and-set
on its sandbox record (`starting`), so one request starts one sandbox whatever redelivers or places
it twice, started (a warm sandbox when one matches), registered, recorded `ready` and answered. An
environment failure (a layer, a mount, the launch) sends it back to placement, to try elsewhere.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from typing import Callable

import msgspec

from bus import streams, subjects, validate
from bus.conn import Bus
from bus.errors import (BusError, CapacityUnavailable, DsecError, EnvironmentFailure, ImageNotFound, InvalidRequest,
                        RequestExpired, SandboxNotFound)
from bus.messages import CreateRequest, ErrorReply, SandboxReady, encode
from bus.records import SandboxRecord
from bus.nodes import decode_node
from bus.pull import Delivery, Lease, Verdict
from edge.backends.base import (Backend, BackendError, CapacityExhausted, LayerUnusable, SandboxSpec, SnapshotGone,
                                SpecRefused)
from edge.capacity import Capacity
from edge.layercache import LayerCache
from edge.noderecord import NodeRecord
from edge.records import Outcome, SandboxRecords, lifecycle
from edge.sandboxes import Running, Sandboxes, wait_stored
from edge.warmpool import WarmPools, limits

log = logging.getLogger(__name__)

CLAIM_STALE = 30.0          # a `starting` claim this long past its request's deadline is abandoned
WAIT = -1                   # _claim: another node is starting this request now
ENV_RETRIES = 1             # times a create whose environment failed is placed again on another node


class CreateLane:
    """Takes, claims, starts and answers the creates of one node."""

    def __init__(self, bus: Bus, node: str, epoch: float, *, capacity: Capacity, node_record: NodeRecord,
                 records: SandboxRecords, sandboxes: Sandboxes, layers: LayerCache, backend: Backend,
                 warm: WarmPools, draining: Callable[[], bool]) -> None:
        self.bus, self.node, self.epoch = bus, node, epoch
        self.capacity, self.node_record, self.records = capacity, node_record, records
        self.sandboxes, self.layers, self.backend, self.warm = sandboxes, layers, backend, warm
        self.draining = draining
        self.creating: set[str] = set()
        self.claims: dict[str, str] = {}  # ids claimed (`starting`) and not yet ready or failed -> their tenant
        self._slow_way: collections.OrderedDict[str, None] = collections.OrderedDict()   # no warm short way
        self._late: set[asyncio.Task] = set()   # sandboxes destroyed after a late not-ours record
        self.created = 0
        self.failed = 0
        self.outcomes: collections.Counter = collections.Counter()   # (message kind, verdict) -> creates handled

    async def on_node_create(self, d: Delivery) -> Verdict:
        """A create from this node's own lane."""
        return await self._on_create(d, streams.ACK_WAIT / 3)

    async def on_pool_create(self, d: Delivery) -> Verdict:
        """A create from the pool's shared lane (nothing new while draining)."""
        if self.draining():   # what was booked on it still runs
            d.nak_delay = 0.5
            return Verdict.NAK
        return await self._on_create(d, streams.POOL_ACK_WAIT / 3)

    async def _on_create(self, d: Delivery, lease_every: float) -> Verdict:
        req: CreateRequest = d.msg   # (decoded by the lane's chain: bus/lanes.py)
        try:
            subjects.token(req.sandbox_id, "sandbox_id"), subjects.token(req.tenant, "tenant")
        except ValueError as exc:
            await self.bus.reply(req.reply_to, ErrorReply(request_id=req.request_id, code=InvalidRequest.code,
                                                       message=f"bad create request: {exc}"))
            return Verdict.TERM
        if req.sandbox_id in self.creating:   # a redelivery while the first delivery still works: ask again later
            d.nak_delay = 0.5                 # (that one answers, or NAKs itself if it fails before its claim)
            return Verdict.NAK
        try:   # this lane is open to any publisher, not only placement: check again, never wait forever
            validate.check_create(req)
            if self.capacity.kind_slots(req.backend) == 0:
                raise CapacityUnavailable(f"node {self.node} does not run backend {req.backend!r} (it runs: "
                                          f"{', '.join(self.capacity.config.backends)})", reason="kind_not_offered")
            if not self.capacity.could_ever_fit(req.resources, req.backend):
                raise CapacityUnavailable(f"node {self.node} can never fit these resources")
        except DsecError as err:
            await self.bus.reply(req.reply_to, ErrorReply(request_id=req.request_id, code=err.code, message=str(err)))
            return self._answered(req)
        running = self.sandboxes.running.get(req.sandbox_id)
        if running is not None:   # served before (ack lost): answer again; another request: refuse
            same = running.record.request_id == req.request_id
            await self.bus.reply(req.reply_to, SandboxReady(request_id=req.request_id, sandbox_id=req.sandbox_id,
                                                         node=self.node) if same else ErrorReply(
                request_id=req.request_id, code=InvalidRequest.code, message="sandbox_id is already in use"))
            return self._answered(req)
        expired = time.time() > req.deadline
        if not expired and not self.capacity.fits(req.resources, req.backend):
            d.nak_delay = 0.2    # room may free before its deadline; until then it waits in JetStream
            return Verdict.NAK
        if not expired:   # booked before any await: two deliveries can never share one slot; the booking
            self.capacity.reserve(req.sandbox_id, req.resources, req.backend)   # leaves the record as the usage enters it
            self.node_record.took(req.request_id)
        self.creating.add(req.sandbox_id)
        lease = Lease(d, every=lease_every)   # a third of the lane's ack wait: never redelivered while it runs
        verdict = Verdict.NAK
        try:
            verdict = await self._create(req)
        except (BusError, EnvironmentFailure) as exc:   # before anything started: try again shortly
            log.warning("create %s retried: %s", req.request_id, exc)
        finally:
            lease.cancel()
            self.creating.discard(req.sandbox_id)
            if req.sandbox_id not in self.sandboxes.running:   # not started here (answered, failed, retried later)
                self.capacity.release(req.sandbox_id)
                self.node_record.changed()
        d.nak_delay = 0.5
        return verdict

    def _answered(self, req: CreateRequest) -> Verdict:
        """The request got its answer here: its booking on this node is no longer needed."""
        self.node_record.took(req.request_id)
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
        self.claims[req.sandbox_id] = req.tenant
        try:
            return await self._start_claimed(req, revision)
        finally:
            self.claims.pop(req.sandbox_id, None)

    async def _start_claimed(self, req: CreateRequest, revision: int) -> Verdict:
        try:
            if time.time() > req.deadline:
                raise RequestExpired("create request expired before a node started it")
            spec = await self._start_sandbox(req)
        except DsecError as err:
            self.capacity.release(req.sandbox_id)
            self.node_record.changed()
            self.failed += 1
            if isinstance(err, EnvironmentFailure) and len(req.avoid) < ENV_RETRIES and time.time() < req.deadline:
                try:
                    self.node_record.took(req.request_id)   # its booking here goes first
                    await self._retry_elsewhere(req, err)
                    return Verdict.ACK
                except DsecError as exc:
                    log.warning("create %s not placed again: %s", req.request_id, exc)
            await self._record_failure(req, err)
            return Verdict.ACK
        running = self._running(req, spec)
        try:
            ready = _ready(await self._record_ready(running, revision, req.deadline))
        except Unrecorded as err:
            await self._undo(req, err, revision)
            return Verdict.ACK
        if not ready:   # our claim was taken (declared lost)
            return await self._drop(req)
        await self._started(req)
        return Verdict.ACK

    async def _undo(self, req: CreateRequest, err: "Unrecorded", claim: int) -> None:
        """A started sandbox whose ready record could not be kept (the node's disk): destroyed, its claim
        freed, the client told why (never `ready` for what no record says runs)."""
        log.error("%s", err)
        self.sandboxes.discard(req.sandbox_id)
        await self._destroy_quietly(req.sandbox_id)
        if claim:
            with contextlib.suppress(DsecError):
                await self.records.free_claim(req.tenant, req.sandbox_id, revision=claim)
        await self.bus.reply(req.reply_to, ErrorReply(request_id=req.request_id, code=err.code, message=str(err)))

    def _running(self, req: CreateRequest, spec: SandboxSpec) -> Running:
        """The started sandbox, registered (serviceable) before its ready record is written."""
        now = time.time()
        rec = SandboxRecord(sandbox_id=req.sandbox_id, tenant=req.tenant, node=self.node, state="ready",
                            command=list(req.command), user=req.user, cwd=req.cwd, cpu_class=req.effective_cpu_class(),
                            network=req.network, image=req.image, backend=req.backend, labels=dict(req.labels), resources=req.resources, created_at=now,
                            expires_at=now + req.ttl, updated_at=now, request_id=req.request_id,
                            layers=[layer.digest for layer in req.layers], version=2, epoch=self.epoch,
                            on_timeout=req.on_timeout)
        running = Running(rec, now + req.ttl, spec=spec, layers=list(req.layers), ttl=req.ttl)
        self.sandboxes.add(running)
        return running

    async def _record_ready(self, running: Running, claim: int, until: float) -> Outcome | None:
        """Write the `ready` record (with its `created` event and trajectory record) over our `starting`
        claim's revision, or over no record (claim 0, a warm claim: a deleted record or this node's own
        claim from an earlier delivery is written over). NOT_OURS when the id is someone else's now.
        None when the bus did not take it by the client's deadline `until`: it runs, the client is told, the
        outbox goes on."""
        rec = running.record
        try:
            pending = await self.records.change(rec, publishes=lifecycle(rec, "created", node=self.node,
                                                                         request_id=rec.request_id),
                                                revision=claim, over_claim=claim > 0)
        except OSError as exc:   # the outbox's disk: nothing durable says it runs, so it must not run
            raise Unrecorded(f"node {self.node} could not record sandbox {rec.sandbox_id} ({exc}); it was not "
                             f"started") from exc
        outcome = await wait_stored(pending.record, rec.sandbox_id, until)
        if outcome is None:   # if it turns out not ours later, what runs here is nobody's: destroy it
            pending.record.add_done_callback(lambda f: self._late_outcome(f, rec.sandbox_id))
        return outcome

    def _late_outcome(self, fut: asyncio.Future, sandbox_id: str) -> None:
        if not fut.cancelled() and fut.exception() is None and not _ready(fut.result()):
            log.error("ready record of %s found someone else's claim: destroying it here", sandbox_id)
            if self.sandboxes.discard(sandbox_id) is not None:
                task = asyncio.ensure_future(self._destroy_quietly(sandbox_id))
                self._late.add(task)
                task.add_done_callback(self._late.discard)

    async def _destroy_quietly(self, sandbox_id: str) -> None:
        with contextlib.suppress(BackendError):
            await self.backend.destroy(sandbox_id)
        self.capacity.release(sandbox_id)
        self.node_record.changed()

    async def _create_warm(self, req: CreateRequest) -> bool:
        """The short way for a create a warm sandbox matches: claim it, then record the id `ready` with one
        create-only write (no `starting` step: the sandbox is ready already). False when there is no warm
        sandbox or the id has another record already (the sandbox is destroyed, and the usual way, which
        this request then always takes, answers)."""
        if time.time() > req.deadline or req.request_id in self._slow_way:
            return False
        warm = self._take_warm(req)
        if warm is None:
            return False
        try:
            paths = await self.layers.ensure(req.layers)   # held by the pool: no fetch
        except Exception:   # the usual way meets it again and makes it a typed failure
            self.warm.retire(warm)
            return False
        spec = _spec(req, paths)
        if not await self._claim_warm(req, spec, warm):
            return False
        running = self._running(req, spec)
        try:
            ready = _ready(await self._record_ready(running, 0, req.deadline))
        except Unrecorded as err:
            await self._undo(req, err, 0)
            return True
        if not ready:   # the id has a record already
            self.sandboxes.discard(req.sandbox_id)
            self._slow_way[req.request_id] = None
            while len(self._slow_way) > 1024:
                self._slow_way.popitem(last=False)
            with contextlib.suppress(BackendError):
                await self.backend.destroy(req.sandbox_id)
            return False
        await self._started(req)
        return True

    async def _started(self, req: CreateRequest) -> None:
        """A sandbox runs and its record says `ready`: answer the client."""
        self.created += 1
        await self.bus.reply(req.reply_to, SandboxReady(request_id=req.request_id, sandbox_id=req.sandbox_id,
                                                     node=self.node))

    async def _drop(self, req: CreateRequest) -> Verdict:
        """A sandbox started under a claim that was taken away: destroy it; answer from the record if it
        is final (or another node's ready). Otherwise the request goes back to placement (attempt + 1,
        under the msg id the reaper would use, so it is placed once either way)."""
        log.warning("claim of %s lost while starting it; destroying it here", req.sandbox_id)
        self.sandboxes.discard(req.sandbox_id)
        await self._destroy_quietly(req.sandbox_id)
        prior, _ = await self.records.get(req.tenant, req.sandbox_id)
        if prior is not None and prior.state != "starting":
            await self._answer_from(req, prior)
            return Verdict.ACK
        again = msgspec.structs.replace(req, node="", pool="", attempt=req.attempt + 1)
        await self.bus.publish(subjects.create_request(req.tenant, req.priority), encode(again),
                               msg_id=f"{req.request_id}.{again.attempt}", retries=3, retry_for=5.0)
        return Verdict.ACK

    async def _claim(self, req: CreateRequest) -> int | None:
        """Claim the sandbox id for this request by compare-and-set on its KV record (state `starting`).

        The record is the one place that decides: a request redelivered, placed twice (JetStream's
        duplicate window does not survive a stream leader change for messages already consumed), or
        sent again by a client starts at most one sandbox, on the node that claimed it. Anyone else
        answers from the record. Returns the claim's revision; None when the request was answered
        from the record; WAIT while another node is starting it."""
        now = time.time()
        mine = SandboxRecord(sandbox_id=req.sandbox_id, tenant=req.tenant, node=self.node, state="starting",
                             network=req.network, image=req.image, backend=req.backend, labels=dict(req.labels), resources=req.resources,
                             created_at=now, updated_at=now, request_id=req.request_id, version=1, epoch=self.epoch)
        revision = 0
        for _ in range(4):
            claimed, prior, revision = await self.records.claim(mine, revision)
            if claimed is not None:
                return claimed
            if prior is None or (prior.node == self.node and prior.state == "starting"
                                 and prior.request_id == req.request_id):
                continue   # free (or junk), or a claim of a crashed run of this node: take it over
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
        owner = decode_node(claim.node, await self.bus.kv_get(streams.NODES_KV, claim.node))
        return owner is None or owner.lost or (claim.epoch != 0 and owner.started_at != claim.epoch)

    async def _answer_from(self, req: CreateRequest, prior: SandboxRecord) -> None:
        """Answer a create whose sandbox id already has a final record (or is in use by another request)."""
        if prior.request_id != req.request_id:
            await self.bus.reply(req.reply_to, ErrorReply(request_id=req.request_id, code=InvalidRequest.code,
                                                       message="sandbox_id is already in use"))
        elif prior.state == "ready":   # served, maybe by another node: point the client there
            await self.bus.reply(req.reply_to, SandboxReady(request_id=req.request_id, sandbox_id=req.sandbox_id,
                                                         node=prior.node))
        else:   # its outcome was recorded; the reply may have died with a crash
            await self.bus.reply(req.reply_to, ErrorReply(
                request_id=req.request_id, code=SandboxNotFound.code, reason=prior.state,
                message=f"sandbox {req.sandbox_id} {prior.state}: {prior.reason}"))

    async def _start_sandbox(self, req: CreateRequest) -> SandboxSpec:
        """Fetch layers and start the backend sandbox; every failure becomes a typed DsecError."""
        if req.network.mode != "none" and self.backend.network is None:   # (before a VM's template boots: seconds)
            raise InvalidRequest(f"sandbox could not start: node {self.node} runs no Aether (network "
                                 f"{req.network.mode!r} needs it: dsec edge without --no-aether)")
        try:
            paths = await self.layers.ensure(req.layers)
            spec = _spec(req, paths)
            if not await self._claim_warm(req, spec):
                await self.backend.create(spec)
        except DsecError:
            raise
        except CapacityExhausted as exc:
            raise CapacityUnavailable(f"sandbox could not start on {self.node}: {exc}") from exc
        except SnapshotGone as exc:   # only this node could start it: no retry elsewhere
            raise ImageNotFound(f"sandbox could not start on {self.node}: {exc}") from exc
        except SpecRefused as exc:
            raise InvalidRequest(f"sandbox could not start: {exc}") from exc
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

    def _take_warm(self, req: CreateRequest) -> str | None:
        """A warm sandbox matching the request, taken from its pool; never for a privileged one (warm ones
        are not), one going on from a memory snapshot, nor one with a network (warm ones have loopback only)."""
        if req.privileged or req.memory or req.network.mode != "none" or req.effective_cpu_class() != "latency":
            return None
        return self.warm.take(req.layers, req.resources, req.request_id, req.backend, req.tenant)

    async def _claim_warm(self, req: CreateRequest, spec: SandboxSpec, warm: str | None = None) -> bool:
        """Give the create a ready sandbox of a matching warm pool (this one, or one taken now)."""
        warm = warm or self._take_warm(req)
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
        await self.records.free_claim(req.tenant, req.sandbox_id)
        again = msgspec.structs.replace(req, node="", pool="", attempt=req.attempt + 1,
                                        avoid=[*req.avoid, self.node])
        rec = SandboxRecord(sandbox_id=req.sandbox_id, tenant=req.tenant, node=self.node, state="failed",
                            image=req.image, backend=req.backend, labels=dict(req.labels), request_id=req.request_id)
        # first (stored, or at least durable): the next attempt's events come after it
        pending = await self.records.change(None, req.sandbox_id, publishes=lifecycle(
            rec, "retried", node=self.node, request_id=req.request_id, detail=f"placed again elsewhere after: {err}",
            nth=again.attempt, failure_class="environment"))
        await wait_stored(pending.done, req.sandbox_id)
        # its own msg id: placement's watchdog may have placed this create again already (the node was slow to
        # take it) as attempt + 1 too, answered as in hand (its record said `starting` here); under that
        # id JetStream dropped this one as a duplicate, and the create was lost (chaos, server-leader)
        await self.bus.publish(subjects.create_request(req.tenant, req.priority), encode(again),
                               msg_id=f"{req.request_id}.{again.attempt}.after-{self.node}", retries=3, retry_for=5.0)

    async def _record_failure(self, req: CreateRequest, err: DsecError) -> None:
        """A create that ends here without a sandbox: failed (or expired), over our claim or no record."""
        state = "expired" if isinstance(err, RequestExpired) else "failed"
        now = time.time()
        rec = SandboxRecord(sandbox_id=req.sandbox_id, tenant=req.tenant, node=self.node, state=state,
                            image=req.image, backend=req.backend, labels=dict(req.labels), resources=req.resources, created_at=now,
                            updated_at=now, reason=str(err), request_id=req.request_id, version=2, epoch=self.epoch)
        try:
            pending = await self.records.change(rec, terminal_event=True, publishes=lifecycle(
                rec, state, node=self.node, request_id=req.request_id, detail=str(err),
                failure_class="environment" if isinstance(err, EnvironmentFailure) else ""))
            await wait_stored(pending.record, req.sandbox_id, req.deadline)
        except OSError as exc:   # the outbox's disk: the client still gets its answer
            log.error("failure of %s not recorded: %s", req.sandbox_id, exc)
        await self.bus.reply(req.reply_to, ErrorReply(request_id=req.request_id, code=err.code, message=str(err)))


class Unrecorded(EnvironmentFailure):
    """A started sandbox's ready record could not be put in the outbox (its disk failed)."""


def _ready(outcome: Outcome | None) -> bool:
    """Whether a ready record's write leaves the sandbox ready for its client: written, found written, or
    not known yet (the bus is away: it runs, the outbox goes on). Anything else: the id ended or is
    someone else's."""
    return outcome in (Outcome.WRITTEN, Outcome.ALREADY, None)


def _spec(req: CreateRequest, paths: list[str]) -> SandboxSpec:
    """What the backend starts for a create, its layers fetched to paths."""
    return SandboxSpec(id=req.sandbox_id, layers=paths, env=dict(req.env), limits=limits(req.resources, req.effective_cpu_class()),
                       cwd=req.cwd, user=req.user, tenant=req.tenant,
                       kind=req.backend, privileged=req.privileged, memory=req.snapshot if req.memory else "",
                       network=req.network if req.network.mode != "none" else None)
