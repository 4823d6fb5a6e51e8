"""An edge's call lanes (fncall): the shared work queues dsec.call.<priority>.<tenant>, pulled by every
node with free fncall workers as competing consumers, so a call needs no placement round trip: a node
pulls only as many calls as it has free workers (the pull is the placement), and a call no node takes
waits in JetStream until its deadline, when the caller gives up with CapacityUnavailable.

Validation happens twice without a round trip: in the SDK before the call is sent, and here when it is
pulled (this lane is open to any publisher). The tenant's quota (KV dsec-quotas, watched here) is checked
here too: a tenant's calls running on this node at once may hold at most its max_cpu cores and
max_memory bytes (the call's resources); one past that waits in the queue (NAK, tried again shortly)
while other tenants' calls run. It is a per-node bound, with no round trip: a tenant's calls on N nodes
may hold N times it. Calls hold no sandbox and are not counted in its max_sandboxes.

Each call is answered once (a CallReply or an ErrorReply on its reply subject) and recorded on its
trajectory timeline (dsec.traj.<tenant>.<job>.<call id>, a TrajRecord of type "call").
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time

import msgspec

from bus import lanes, streams, subjects, validate
from bus.conn import Bus, kv_watch
from bus.errors import BusError, DsecError, EnvironmentFailure, ExecFailed, ImageNotFound, InvalidRequest
from bus.images import ImageRegistry
from bus.callwire import CallReply, CallRequest, call_decoder
from bus.messages import ErrorReply, Resources, encode
from bus.records import Quota, TrajRecord, quota_decoder
from bus.pull import Delivery, Lease, Verdict
from chronus.shell import command_argv
from chronus.trajfit import fit
from edge.backends.base import BackendError
from edge.backends.fncall import CallSpec, FnCallBackend
from edge.layercache import LayerCache
from edge.warmpool import limits

log = logging.getLogger(__name__)

DONE_KEPT = 4096            # answered call ids remembered (a redelivery after a lost ack is not run again)

class CallLane:
    """Pulls calls while the node has free workers; runs, answers and records each."""

    def __init__(self, bus: Bus, node: str, fncall: FnCallBackend, layers: LayerCache) -> None:
        self.bus, self.node, self.fncall, self.layers = bus, node, fncall, layers
        self.images = ImageRegistry(bus)   # one for the lane: names resolve from its cache (5 s), not per call
        self.quotas: dict[str, Quota] = {}   # tenant -> its quota (watched)
        self._held: dict[str, list[Resources]] = collections.defaultdict(list)   # tenant -> its running calls
        self._quota_watch = None
        self.held_back = 0   # calls left in the queue for a while because their tenant was at its quota
        self._workers: dict = {}   # priority -> its pull worker
        self._running: set[str] = set()
        self._done: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.served = 0
        self.duplicates = 0
        self.outcomes: collections.Counter = collections.Counter()   # (message kind, verdict) -> calls handled
        self._unplaced = 0   # calls in flight here that have no worker yet

    async def start(self) -> None:
        """Pull both priorities; latency calls first when workers are scarce (batch keeps one back)."""
        self._quota_watch = await kv_watch(self.bus, streams.QUOTAS_KV, self._on_quota)
        for priority in subjects.PRIORITIES:
            self._workers[priority] = await self.bus.pull_worker(
                streams.call_consumer(priority), self._handle, credit=lambda p=priority: self._credit(p),
                steps=[lanes.counted(self.outcomes),
                       *lanes.tenant_lane(self.bus, call_decoder, "call", 3, 4)])   # dsec.call.<priority>.<tenant>

    def _credit(self, priority: str) -> int:
        """What a consumer may have in flight: its calls in flight plus the workers free for more, less the
        calls here that hold none yet (they take the next ones). The pull worker subtracts what it has in
        flight, so it asks for the free workers nobody here waits for (batch leaves one of them)."""
        worker = self._workers.get(priority)
        keep = 0 if priority == "latency" else 1
        return (worker.in_flight if worker else 0) + max(0, self.fncall.free() - keep - self._unplaced)

    async def stop(self) -> None:
        for w in self._workers.values():
            await w.stop(drain=False)
        self._workers = {}
        if self._quota_watch is not None:
            self._quota_watch.cancel()

    def _on_quota(self, key: str, raw: bytes | None, _revision: int) -> None:
        try:
            quota = quota_decoder.decode(raw) if raw is not None else None
        except (msgspec.DecodeError, msgspec.ValidationError):
            quota = None
        if quota is None:
            self.quotas.pop(key, None)
        else:
            self.quotas[key] = quota

    def _within_quota(self, req: CallRequest) -> bool:
        """Whether the tenant's running calls here plus this one stay within its max_cpu / max_memory."""
        q = self.quotas.get(req.tenant)
        if q is None:
            return True
        held = self._held[req.tenant]
        cpu = sum(r.cpu for r in held) + req.resources.cpu
        memory = sum(r.memory for r in held) + req.resources.memory
        return (not q.max_cpu or cpu <= q.max_cpu + 1e-9) and (not q.max_memory or memory <= q.max_memory)

    def poke(self) -> None:
        """A worker came free: pull again now."""
        for w in self._workers.values():
            w.poke()

    async def _handle(self, d: Delivery) -> Verdict:
        req: CallRequest = d.msg   # (decoded, its tenant from the subject: the lane's chain, bus/lanes.py)
        if req.call_id in self._running:   # a redelivery while it runs here: it answers when done
            d.nak_delay = 1.0
            return Verdict.NAK
        if req.call_id in self._done:      # answered before; the ack was lost
            self.duplicates += 1
            return Verdict.ACK
        if req.deadline and time.time() > req.deadline:   # the caller gave up (CapacityUnavailable): not run
            return Verdict.ACK
        if not self._within_quota(req):   # its tenant holds its share here: it waits, others run
            self.held_back += 1
            d.nak_delay = 0.05
            return Verdict.NAK
        self._running.add(req.call_id)
        self._held[req.tenant].append(req.resources)
        lease = Lease(d, every=streams.CALL_ACK_WAIT / 3)
        placed = False

        def on_worker() -> None:
            nonlocal placed
            placed = True
            self._unplaced -= 1

        self._unplaced += 1
        try:
            reply = await self._serve(req, on_worker)
        except BusError as exc:   # the image could not be read now: another try shortly (here or elsewhere)
            log.warning("call %s retried: %s", req.call_id, exc)
            d.nak_delay = 0.5
            return Verdict.NAK
        finally:
            if not placed:
                self._unplaced -= 1
            lease.cancel()
            self._running.discard(req.call_id)
            self._held[req.tenant].remove(req.resources)
            if not self._held[req.tenant]:
                del self._held[req.tenant]
        self._done[req.call_id] = None
        while len(self._done) > DONE_KEPT:
            self._done.popitem(last=False)
        await self.bus.reply(req.reply_to, reply)
        self.served += 1
        if isinstance(reply, CallReply):
            await asyncio.sleep(0)   # the answer is flushed first (its flush is scheduled): the record waits
            await self._record(req, reply)
        return Verdict.ACK

    async def _serve(self, req: CallRequest, on_worker=lambda: None) -> CallReply | ErrorReply:
        started = time.time()
        try:
            validate.check_call(req)
            refs = await self.images.compose(req.image)
            paths = await self.layers.ensure(refs)
            out = await self.fncall.call(CallSpec(
                layers=[str(p) for p in paths], limits=limits(req.resources),
                argv=command_argv(list(req.argv), req.shell, self.fncall.trusted_shell), env=dict(req.env),
                cwd=req.cwd, stdin=req.stdin, timeout=req.timeout, files=dict(req.files),
                read_back=list(req.read_back), max_output=req.max_output), on_worker=on_worker)
        except BusError:
            raise
        except (InvalidRequest, ImageNotFound) as err:
            return ErrorReply(request_id=req.call_id, code=err.code, message=str(err))
        except DsecError as err:
            return ErrorReply(request_id=req.call_id, code=err.code, message=str(err))
        except BackendError as exc:
            return ErrorReply(request_id=req.call_id, code=EnvironmentFailure.code,
                              message=f"call {req.call_id} on node {self.node}: {exc}")
        finally:
            self.poke()
        if out.error:   # never started: the command's own failure, typed like an exec's
            return ErrorReply(request_id=req.call_id, code=ExecFailed.code, message=out.error)
        r = out.result
        return CallReply(call_id=req.call_id, exit_code=r.exit_code, stdout=out.stdout, stderr=out.stderr,
                         duration=r.duration, cpu_time=r.cpu_time, peak_memory=r.peak_memory, timed_out=r.timed_out,
                         truncated=out.truncated, files=out.files, unread=out.unread, worker=out.worker, node=self.node,
                         waited=max(0.0, started - req.sent_at) if req.sent_at else 0.0)

    async def _record(self, req: CallRequest, reply: CallReply) -> None:
        """Its trajectory record (best effort within a short retry: the caller has its answer already)."""
        job = subjects.job_of(req.labels)
        now = time.time()
        traj = TrajRecord(id=req.call_id, type="call", sandbox_id="", tenant=req.tenant, job=job, node=self.node,
                          at=now, exec_id=req.call_id, argv=list(req.argv), shell=req.shell, cwd=req.cwd,
                          env_keys=sorted(req.env), started_at=now - reply.duration, ended_at=now,
                          exit_code=reply.exit_code, timed_out=reply.timed_out, truncated=reply.truncated,
                          cpu_time=reply.cpu_time, peak_memory=reply.peak_memory,
                          stdout_bytes=len(reply.stdout), stderr_bytes=len(reply.stderr),
                          stdout=reply.stdout[:64 << 10], stderr=reply.stderr[:64 << 10],
                          detail=f"worker {reply.worker}" + "".join(f"; {p} not read back: {why}"
                                                                    for p, why in reply.unread.items()))
        try:
            await self.bus.publish(subjects.trajectory(req.tenant, job, req.call_id), encode(fit(traj)),
                                   msg_id=f"{req.call_id}-traj", retries=3, retry_for=5.0)
        except BusError as exc:
            log.warning("trajectory of call %s not recorded: %s", req.call_id, exc)


__all__ = ["CallLane"]
