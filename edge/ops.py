"""An edge's op lane: dsec.node.<node>.exec.> — execs go to Chronus (chronus/execs.py); destroy,
files, suspend/resume, snapshot and rollback to the node's sandboxes (edge/sandboxes.py).

Only the dispatch lives here: decode, route, answer once. Every op ends in exactly one answer, a
typed error for a sandbox this node does not run (with the recorded reason) or a backend failure.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time

import msgspec

from bus import kinds, lanes, streams, subjects, validate
from bus.conn import Bus
from bus.errors import (DsecError, FileOpError, InvalidRequest, RateLimited, RequestExpired, SandboxError,
                        SandboxNotFound)
from bus.messages import (
    FILE_OPS, FILE_PIECE, DestroyRequest, ErrorReply, ExecRequest, FileOp, ListProcesses, OkReply, ReadFile,
    ResumeRequest, RollbackRequest, SetNetworkRequest, SetTimeoutRequest, SnapshotRequest, SuspendRequest, WriteFile,
    encode, op_decoder)
from bus.records import snapshot_decoder
from bus.pull import Delivery, Lease, Verdict
from chronus.execs import Execs
from edge.backends.treeops import MAX_AFTER, MAX_DEPTH, check_metadata
from edge.backends.base import BackendError, SandboxGone
from edge.records import Outcome
from edge.sandboxes import ANSWERING_BY, Sandboxes

log = logging.getLogger(__name__)

MAX_READ = 700_000          # a reply is one message: 1 MiB max payload, base64 in JSON
# The lane holds up to max_execs + OP_BACKLOG deliveries. An op other than an exec waits its tenant's turn
# there: one tenant runs at most PER_TENANT[kind] of each kind at once. A tenant holds at most its share of
# OP_BACKLOG (split evenly among the tenants holding some, at least SHARE_MIN); past it, RateLimited at once.
# (FIFO with 256 held, one tenant's 1,500 parallel suspend/resume loops put another's exec at 0.9 s, its
# 12,000 at 22 s: helper A4. Held here, not in JetStream, they are pulled past: python -m bench.oplane.)
OP_BACKLOG = 8192
PER_TENANT = {"ops": 64, "destroy": 64, "files": 2, "snapshots": 2}   # (files and snapshots run in the edge's
# few threads; a destroy never waits behind its tenant's other ops)
SHARE_MIN = 64
# File ops and snapshots carry up to 1 MiB each: one tenant holds at most HEAVY_WAITING of each kind (as when
# the lane's credit was 256: 150 files written at once must fit), and the lane at most HEAVY_LANE of them in
# all (its memory: ~0.4 GB)
HEAVY = ("files", "snapshots")
HEAVY_WAITING = 192
HEAVY_LANE = 256
NEEDS = {"write_file": "files", "read_file": "files", "file_op": "file_tree", "suspend": "suspend", "resume": "suspend",
         "snapshot": "snapshot", "rollback": "snapshot", "memory snapshot": "memory_snapshot",
         "set_network": "network"}   # op -> the capability (bus/kinds.py) it needs


class OpLane:
    """Pulls a node's op lane and runs each op; execs run concurrently up to max_execs."""

    def __init__(self, bus: Bus, node: str, max_execs: int, execs: Execs, sandboxes: Sandboxes) -> None:
        self.bus = bus
        self.node = node
        self.max_execs = max_execs
        self.execs = execs
        self.sandboxes = sandboxes
        self.outcomes: collections.Counter = collections.Counter()   # (message kind, verdict) -> ops handled
        self.network = None          # the edge's NodeNetwork (edge/network.py), set by the edge
        self._worker = None
        self._turns: dict[tuple, list] = {}   # (tenant, kind) -> [semaphore, its ops running or waiting]
        self._holding: collections.Counter = collections.Counter()   # tenant -> its ops running or waiting
        self._heavy = 0   # file ops and snapshots running or waiting, every tenant's

    @property
    def duplicates(self) -> int:
        """Execs delivered again and not run (ack lost, lease lost, client retry)."""
        return self.execs.duplicates

    async def start(self) -> None:
        """Start pulling ops (and answering running execs' controls)."""
        await self.execs.start()
        self._worker = await self.bus.pull_worker(streams.edge_ops_consumer(self.node), self._handle,
                                                  credit=lambda: self.max_execs + OP_BACKLOG,
                                                  steps=[lanes.counted(self.outcomes),
                                                         *lanes.tenant_lane(self.bus, op_decoder, "op", 4, 6,
                                                                            self._bad_op)])
        # (dsec.node.<node>.exec.<tenant>.<sandbox>: an op of any other shape is refused, never served as the
        # sandbox's owner)

    async def stop(self) -> None:
        """Stop pulling; cancel ops in flight (their sandboxes are about to be destroyed)."""
        if self._worker:
            await self._worker.stop(drain=False)
        await self.execs.stop()

    async def _bad_op(self, d: Delivery, env, exc: Exception) -> None:
        """An undecodable exec still ends in one exit record (its waiter reads the stream, not a reply), on
        its subject's tenant's output (none when the subject names no tenant)."""
        target = subjects.op_target(d.subject)
        if env.exec_id and env.sandbox_id and target is not None and target[0]:
            await self.execs.reject(target[0], env.sandbox_id, env.exec_id, InvalidRequest(f"bad exec request: {exc}"))

    async def _handle(self, d: Delivery) -> Verdict:
        op, tenant = d.msg, d.tenant   # (decoded, the tenant from the subject: the lane's chain, bus/lanes.py)
        target = subjects.op_target(d.subject)
        if target is not None and target[1] != op.sandbox_id:
            err = InvalidRequest(f"the op names sandbox {op.sandbox_id!r} on the lane of {target[1]!r}")
            if isinstance(op, ExecRequest):
                await self.execs.reject(tenant, op.sandbox_id, op.exec_id, err)
            else:
                await self._answer(op, _raise(err))
            return Verdict.ACK
        sb = self.sandboxes
        if not isinstance(op, ExecRequest) and (op.sandbox_id not in sb.running
                                                or sb.running[op.sandbox_id].record.tenant != tenant):
            await self._answer(op, _raise(await sb.gone(op.sandbox_id, tenant)))   # (another tenant's: never existed)
            return Verdict.ACK
        if isinstance(op, ExecRequest):   # (an exec leases its own delivery while it runs)
            return await self.execs.handle(msgspec.structs.replace(op, tenant=tenant), d)
        lease = Lease(d)   # an op waiting its turn, or a snapshot, may take past the lane's ack wait (30 s): it
        try:               # was delivered again, and a snapshot taken twice
            kind, work = self._work(op, tenant)
            await self._answer(op, self._in_turn(op, tenant, kind, work))
        finally:
            lease.cancel()
        return Verdict.ACK

    def _work(self, op, tenant: str) -> tuple[str, object]:
        """The op's kind (its tenant's turns: PER_TENANT) and its work, a coroutine function."""
        sb, sid = self.sandboxes, op.sandbox_id
        match op:
            case DestroyRequest():
                return "destroy", lambda: self._on(sid, "destroy", lambda: self._destroy(tenant, sid), tenant=tenant)
            case WriteFile():
                return "files", lambda: self._write(op, tenant)
            case ReadFile():
                return "files", lambda: self._read(op, tenant)
            case FileOp():
                return "files", lambda: self._file_op(op, tenant)
            case SetTimeoutRequest():
                return "ops", lambda: self._on(sid, "set_timeout", lambda: self._set_timeout(op), tenant=tenant)
            case ListProcesses():
                return "ops", lambda: self._on(sid, "list_processes", lambda: self._processes(op, tenant), tenant=tenant)
            case SuspendRequest():
                return "ops", lambda: self._on(sid, "suspend", lambda: sb.suspend(sid), tenant=tenant)
            case ResumeRequest():
                return "ops", lambda: self._on(sid, "resume", lambda: sb.resume(sid), tenant=tenant)
            case SnapshotRequest():
                async def snap() -> bytes:
                    return encode(await sb.snapshot(sid, op.tag, op.memory))
                return "snapshots", lambda: self._on(sid, "memory snapshot" if op.memory else "snapshot", snap,
                                                     tenant=tenant)
            case RollbackRequest():
                return "ops", lambda: self._on(sid, "rollback", lambda: self._rollback(op, tenant), tenant=tenant)
            case SetNetworkRequest():
                return "ops", lambda: self._on(sid, "set_network", lambda: self.network.set_policy(sid, op.network),
                                               tenant=tenant)
        raise AssertionError(f"no work for {type(op).__name__}")   # (op_decoder decodes only the above)

    async def _answer(self, op, work) -> None:
        """Run work (unless the op expired) and answer the op once, whatever happens. A change work makes is
        answered once its record is stored, or just before the op's deadline (edge.sandboxes.ANSWERING_BY)."""
        answering = ANSWERING_BY.set((op.deadline, asyncio.current_task()))
        try:
            if op.deadline and time.time() > op.deadline:
                work.close()
                raise RequestExpired("request expired before the node served it (its node was busy)")
            data = await work
            reply = OkReply(request_id=op.request_id, data=data or b"")
        except DsecError as err:
            reply = ErrorReply(request_id=op.request_id, code=err.code, message=str(err),
                               reason=str(err.details.get("reason", "")))
        except Exception as exc:   # a bug must still answer, once, and not loop through redeliveries
            log.exception("op %s on %s failed", type(op).__name__, op.sandbox_id)
            reply = ErrorReply(request_id=op.request_id, code=SandboxError.code,
                               message=f"{type(op).__name__} failed on the node: {exc.__class__.__name__}: {exc}")
        finally:
            ANSWERING_BY.reset(answering)
        await self.bus.reply(op.reply_to, reply)

    def share(self, tenant: str) -> int:
        """How many ops (waiting or running) the tenant may hold on the lane now."""
        holders = len(self._holding) + (tenant not in self._holding)
        return max(SHARE_MIN, OP_BACKLOG // holders)

    async def _in_turn(self, op, tenant: str, kind: str, work):
        """work(), once one of the tenant's PER_TENANT[kind] turns is free; RateLimited at once past the
        tenant's share of the lane's backlog (so another tenant's ops are still pulled, and run in their own
        turns). One whose deadline passed while it waited is refused, not run. A tenant's projects share it."""
        root = subjects.tenant_root(tenant)
        key, heavy = (root, kind), kind in HEAVY
        held, share, mine = self._holding[root], self.share(root), self._turns.get(key, (None, 0))[1]
        if held >= share and kind != "destroy":   # (a destroy is never refused: the sandboxes bound them)
            raise RateLimited(f"{subjects.describe(tenant)} has {held} ops waiting or running on node {self.node}, "
                              f"its share of the node's op lane ({share}, {len(self._holding)} tenants holding "
                              f"some): wait for some to end")
        if heavy and (mine >= HEAVY_WAITING or self._heavy >= HEAVY_LANE):
            raise RateLimited(f"{subjects.describe(tenant)} has {mine} {kind} ops waiting or running on node "
                              f"{self.node} ({self._heavy} of every tenant's), the most it may: wait for some to end")
        turn = self._turns.setdefault(key, [asyncio.Semaphore(PER_TENANT[kind]), 0])
        turn[1] += 1
        self._holding[root] += 1
        self._heavy += heavy
        try:
            async with turn[0]:
                if op.deadline and time.time() > op.deadline:
                    raise RequestExpired("request expired while the tenant's earlier ops ran")
                return await work()
        finally:
            turn[1] -= 1
            if not turn[1]:
                del self._turns[key]
            self._heavy -= heavy
            self._holding[root] -= 1
            if not self._holding[root]:
                del self._holding[root]

    async def _on(self, sandbox_id: str, what: str, work, failure: type[DsecError] = SandboxError, tenant: str = ""):
        """Run work() for a sandbox this node runs: typed errors for a gone sandbox, an operation its kind
        lacks (Unsupported: the SDK refuses it first; this is the guard for any other publisher) or a
        backend failure."""
        if sandbox_id not in self.sandboxes.running:
            raise await self.sandboxes.gone(sandbox_id, tenant)
        kind = self.sandboxes.backend.kind_of(sandbox_id)
        if kind and what in NEEDS:
            kinds.require(kind, NEEDS[what], what)
        try:
            return await work()
        except (KeyError, SandboxGone):
            raise await self.sandboxes.gone(sandbox_id, tenant) from None
        except BackendError as exc:   # a destroy is recorded anyway; what the kernel kept is reconciled at restart
            raise failure(str(exc) if failure is FileOpError else f"{what} of {sandbox_id} failed: {exc}") from exc

    async def _destroy(self, tenant: str, sandbox_id: str) -> None:
        """Destroy by request; SandboxNotFound (how it ended) when it had ended otherwise first."""
        if await self.sandboxes.destroy(sandbox_id, "destroyed", "destroyed by request") is Outcome.FINAL:
            rec, _ = await self.sandboxes.records.get(tenant, sandbox_id)   # it ended otherwise first: say how
            reason = rec.state if rec is not None else "destroyed"
            raise SandboxNotFound.ended(sandbox_id, reason, rec.reason if rec is not None else "")

    async def _write(self, op: WriteFile, tenant: str) -> None:
        validate.file_path(op.path)
        await self._on(op.sandbox_id, "write_file", lambda: self.sandboxes.backend.write_file(
            op.sandbox_id, op.path, op.data, op.mode), FileOpError, tenant)

    async def _read(self, op: ReadFile, tenant: str) -> bytes:
        validate.file_path(op.path)
        if not 0 < op.limit <= MAX_READ:
            raise InvalidRequest(f"limit: read_file returns 1..{MAX_READ} bytes per call, got {op.limit}")
        return await self._on(op.sandbox_id, "read_file", lambda: self.sandboxes.backend.read_file(
            op.sandbox_id, op.path, op.limit), FileOpError, tenant)

    async def _processes(self, op: ListProcesses, tenant: str) -> bytes:
        return encode(self.execs.processes(op.sandbox_id, tenant))

    async def _set_timeout(self, op: SetTimeoutRequest) -> None:
        if not 0 <= op.timeout <= validate.MAX_TTL:   # as a create's ttl
            raise InvalidRequest(f"timeout must be 0..{validate.MAX_TTL:.0f} seconds, got {op.timeout}")
        await self.sandboxes.set_timeout(op.sandbox_id, op.timeout)

    async def _file_op(self, op: FileOp, tenant: str) -> bytes:
        if op.op not in FILE_OPS:
            raise InvalidRequest(f"op: one of {', '.join(FILE_OPS)}, got {op.op!r}")
        if not 0 < op.length <= 2 * FILE_PIECE or op.offset < 0 or len(op.data) > 2 * FILE_PIECE:
            raise InvalidRequest(f"a file op moves 1..{2 * FILE_PIECE} bytes per piece, from offset >= 0")
        if not 1 <= op.depth <= MAX_DEPTH:
            raise InvalidRequest(f"depth must be 1..{MAX_DEPTH}, got {op.depth}")
        try:
            check_metadata(op.metadata)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        validate.file_path(op.path)
        if op.op == "rename":
            validate.file_path(op.dest, "dest")
        if "\0" in op.after or len(op.after) > MAX_AFTER:
            raise InvalidRequest(f"after: a path of at most {MAX_AFTER} characters without NUL (a listing's last)")
        async def work() -> bytes:
            who = await self.sandboxes.file_user(op.sandbox_id, op.user)
            return await self.sandboxes.backend.file_op(op.sandbox_id, op, who)
        return await self._on(op.sandbox_id, "file_op", work, FileOpError, tenant)

    async def _rollback(self, op: RollbackRequest, tenant: str) -> None:
        raw = (await self.bus.kv_get(streams.SNAPSHOTS_KV, subjects.record_key(tenant, op.snapshot_id))
               if subjects.is_token(op.snapshot_id) else None)
        try:
            snap = snapshot_decoder.decode(raw) if raw is not None else None
        except (msgspec.DecodeError, msgspec.ValidationError):
            snap = None
        if snap is None or snap.tenant != tenant:
            raise InvalidRequest(f"snapshot {op.snapshot_id} not found")
        await self.sandboxes.rollback(op.sandbox_id, snap)


async def _raise(err: Exception):
    """A coroutine that fails with err (an answer through _answer, for a check made before any work)."""
    raise err
