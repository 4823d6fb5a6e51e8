"""The sandboxes a node runs, and their lifecycle after create: suspend, resume, snapshot, rollback,
destroy. Every state change is recorded through edge/records.py (the one writer), by way of the
outbox: durable before anyone is told, in order per sandbox, retried until the bus has it.

A sandbox is registered here before its `ready` record is written, so it is serviceable the moment
any client can see it ready. It is also Chronus's host (chronus/execs.py): what execs ask of the node.
"""
from __future__ import annotations

import asyncio
import collections
import contextvars
import dataclasses
import logging
import secrets
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import msgspec

from bus import kinds, streams, subjects, validate
from bus.conn import Bus
from bus.errors import (BusError, CapacityUnavailable, DsecError, EnvironmentFailure, FileOpError,
                        InvalidRequest, SandboxNotFound)
from bus.messages import LayerRef
from bus.records import SandboxRecord, SnapshotRecord
from chronus.control import Gone, RunFailed
from edge.backends.base import (TRUSTED_SHELL, BackendError, CapacityExhausted, ExecControl, ExecResult, OutputSink,
                                SandboxGone, SnapshotTooLarge, SandboxSpec)
from edge.backends.registry import BackendSet
from edge import users
from edge.deadlines import Deadlines
from edge.layercache import LayerCache
from edge.outbox import Publish
from edge.records import TERMINAL, Outcome, SandboxRecords, lifecycle

log = logging.getLogger(__name__)

RECORD_WAIT = 8.0       # seconds a change nobody asked for (a TTL's end) waits for its record (kept trying after)
RECORD_WAIT_MAX = 60.0  # seconds an answer waits for its record at most, whatever its caller's deadline
REPLY_MARGIN = 1.0      # seconds before its caller's deadline such an answer goes out anyway
# The deadline (unix time) of the request being answered: a change made for it is answered once its record is
# stored, or just before that deadline. Not a fixed RECORD_WAIT: with one server of 3 killed, the bucket's new
# leader and the outbox's backoff took past 8 s, and create() or destroy() returned before its record said
# so: a cleanup by the `ready` records missed a sandbox still running (helper F3).
# Held with the task answering it: a task or callback made meanwhile inherits the variable (a sandbox's death
# watcher registered by a rollback), and its changes are nobody's answer.
ANSWERING_BY: contextvars.ContextVar[tuple[float, object]] = contextvars.ContextVar("answering_by",
                                                                                    default=(0.0, None))
ENDED_KEPT = 100_000    # sandboxes that ended here whose final state is remembered (a late op's answer)


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
    timeouts: int = 0                # set_timeout calls so far (names their events)
    ending: str = ""                 # the final state it is being destroyed into
    ending_why: str = ""             # ...and why (its record's reason)
    users: dict[str, "users.ExecUser | None"] = field(default_factory=dict)   # exec user name -> whom, resolved once
    ttl: float = 0.0                 # seconds it was last given to live (create's ttl, set_timeout): a resume of
                                     # one its TTL suspended (on_timeout="suspend") gives it that again
    freezing: asyncio.Lock = field(default_factory=asyncio.Lock)   # suspend, resume, snapshot's pack, rollback:
                                     # one at a time (a suspend during a pack was thawed by the pack's end)

    def next(self, **changes) -> SandboxRecord:
        """Its record with these changes, one version on."""
        self.record = msgspec.structs.replace(self.record, version=self.record.version + 1, updated_at=time.time(),
                                              **changes)
        return self.record


class Sandboxes:
    """The running sandboxes of one node and what happens to them after create."""

    def __init__(self, bus: Bus, node: str, backend: BackendSet, records: SandboxRecords, layers: LayerCache,
                 state_dir: Path, released: Callable[[str], None], settle: Callable) -> None:
        self.bus = bus
        self.node = node
        self.backend = backend
        self.records = records
        self.layers = layers
        self.state_dir = Path(state_dir)
        self.released = released          # released(sandbox_id): its capacity is free again
        self.settle = settle              # settle(sandbox_id): its execs recorded their ends
        self.running: dict[str, Running] = {}
        self.ended: collections.OrderedDict[str, tuple[str, str]] = collections.OrderedDict()   # id -> (final
                                                                                      # state here, why)
        self._memory_owner: dict[str, str] = {}   # memory snapshot held by the backend -> its tenant
        self.deadlines = Deadlines()      # when the TTL loop next looks at each (see deadline)

    # ---- registry -----------------------------------------------------------------------------------

    def add(self, running: Running) -> None:
        """A sandbox now runs here (before its ready record is written)."""
        self.running[running.record.sandbox_id] = running
        self.deadlines.look(running.record.sandbox_id)

    def deadline(self, sandbox_id: str, max_paused: float) -> float | None:
        """When the TTL loop must end (or suspend) it, unix time: its expiry, or while it is suspended the
        end of its --max-paused; None when it has neither or is gone or ending."""
        running = self.running.get(sandbox_id)
        if running is None or running.ending:
            return None
        if running.suspended_since:
            return running.suspended_since + max_paused
        return running.expires_at or None

    def discard(self, sandbox_id: str) -> Running | None:
        """Forget a sandbox whose record never became ours (its claim was taken)."""
        return self.running.pop(sandbox_id, None)

    async def record(self, running: Running, state: str = "", *, event: str = "", detail: str = "",
                     nth: int = 0, wait: bool = True, **changes) -> Outcome | None:
        """Record a change of a running sandbox (and its event): durable now, stored when the bus has it;
        with wait, returns its Outcome once the record is stored (None after RECORD_WAIT: kept trying)."""
        rec = running.next(**({"state": state} if state else {}), **changes)
        publishes = lifecycle(rec, event, node=self.node, detail=detail, nth=nth) if event else []
        pending = await self.records.change(rec, publishes=publishes, terminal_event=rec.state in TERMINAL)
        return await wait_stored(pending.record, rec.sandbox_id) if wait else None

    async def refresh(self, older_than: float, at_most: int) -> int:
        """Write again (no event, one version on) the records of up to at_most running sandboxes last written
        before older_than (wall time); how many. The sandboxes bucket drops a key not written for its age (2
        days), and a sandbox may run unchanged for longer (a TTL of up to 7 days, a 7-day set_timeout, a
        suspend): its record was gone, `get` said not found and its end could not be recorded."""
        old = [r for r in self.running.values() if not r.ending and r.record.updated_at < older_than]
        done = 0
        for running in sorted(old, key=lambda r: r.record.updated_at)[:at_most]:
            if self.running.get(running.record.sandbox_id) is running and not running.ending:   # (ended meanwhile)
                await self.record(running, wait=False)
                done += 1
        return done

    # ---- what Chronus asks (ExecHost) ---------------------------------------------------------------

    def record_of(self, sandbox_id: str) -> SandboxRecord | None:
        running = self.running.get(sandbox_id)
        return running.record if running is not None and not running.ending else None

    def suspended(self, sandbox_id: str) -> bool:
        running = self.running.get(sandbox_id)
        return bool(running and running.suspended_since)

    def ending(self, sandbox_id: str) -> str:
        return self._ending(sandbox_id)[0]

    def ending_why(self, sandbox_id: str) -> str:
        return self._ending(sandbox_id)[1]

    def _ending(self, sandbox_id: str) -> tuple[str, str]:
        """(final state, why) of a sandbox ending or ended here; ("", "") for one that is not."""
        running = self.running.get(sandbox_id)
        if running is not None:
            return running.ending, running.ending_why
        return self.ended.get(sandbox_id, ("", ""))

    async def gone(self, sandbox_id: str, tenant: str = "") -> SandboxNotFound:
        """The typed error for a sandbox this node does not run, with the reason: how it ended here, else
        what its record says (a `ready` of this node that it does not run was lost with an earlier run).
        Asked for `tenant`, another tenant's sandbox is one that never existed."""
        unknown = SandboxNotFound.ended(sandbox_id, "never_existed")
        running = self.running.get(sandbox_id)
        if tenant and running is not None and running.record.tenant != tenant:
            return unknown
        reason, why = self._ending(sandbox_id)   # ending here now, or ended here
        whose = tenant or (running.record.tenant if running is not None else "")
        rec = None
        if whose and (not reason or (tenant and running is None)):   # (its record is keyed by its tenant)
            try:
                rec, _ = await self.records.get(whose, sandbox_id)
            except BusError:
                if tenant and running is None:
                    return unknown   # (how an id ended here is told only to a tenant whose record it is)
                reason = reason or "unknown"
            if tenant and running is None and rec is None:
                return unknown       # ended here, but not as this tenant's
        if not reason:
            if rec is None:
                reason = "never_existed"
            elif rec.state in TERMINAL or rec.state == "starting":
                reason = rec.state
            else:
                reason = "node_lost" if rec.node == self.node else "not_on_this_node"
        why = why or (rec.reason if rec is not None and rec.state == reason else "")
        return SandboxNotFound.ended(sandbox_id, reason, why)

    def trusted_shell(self, sandbox_id: str) -> str:
        """The shell string commands run with in this sandbox (its backend's)."""
        try:
            return self.backend.trusted_shell_of(sandbox_id)
        except BackendError:
            return TRUSTED_SHELL   # gone: the exec fails as gone, whatever it would have run

    async def run(self, sandbox_id: str, argv: list[str], *, env: dict[str, str], cwd: str, stdin: bytes | None,
                  timeout: float, sink: OutputSink, control: ExecControl, user: str = "",
                  pty: tuple[int, int] | None = None) -> ExecResult:
        running = self.running.get(sandbox_id)
        spec = running.spec if running is not None else None
        cwd = cwd or (spec.cwd if spec is not None else "") or "/"     # the image's WorkingDir by default
        try:
            who = await self._user(sandbox_id, running, user or (spec.user if spec is not None else ""))
            if who is not None:
                env = {"HOME": who.home, "USER": who.name or str(who.uid), "LOGNAME": who.name or str(who.uid),
                       **env}
            if pty is not None:
                kind = self.backend.kind_of(sandbox_id)
                if kind:
                    kinds.require(kind, "pty", "a terminal")
                env = {"TERM": "xterm-256color", **env}
            return await self.backend.exec(sandbox_id, argv, env=env, cwd=cwd, stdin=stdin, timeout=timeout,
                                           sink=sink, control=control, user=who,
                                           **({"pty": pty} if pty is not None else {}))
        except SandboxGone as exc:
            raise Gone(str(exc)) from exc
        except (BackendError, DsecError) as exc:
            raise RunFailed(str(exc)) from exc

    async def watch(self, sandbox_id: str, path: str, recursive: bool, *, timeout: float, sink: OutputSink,
                    control: ExecControl) -> ExecResult:
        """A directory watch (files.watch) in a sandbox of a kind that has them."""
        try:
            kind = self.backend.kind_of(sandbox_id)
            if kind:
                kinds.require(kind, "watch", "files.watch")
            return await self.backend.watch(sandbox_id, path, recursive, timeout=timeout, sink=sink, control=control)
        except SandboxGone as exc:
            raise Gone(str(exc)) from exc
        except (BackendError, DsecError) as exc:
            raise RunFailed(str(exc)) from exc

    async def file_user(self, sandbox_id: str, name: str) -> users.ExecUser | None:
        """Whom a file op runs as: name, else the sandbox's default user (its image's User, else root)."""
        running = self.running.get(sandbox_id)
        try:
            return await self._user(sandbox_id, running, name or (running.spec.user if running is not None else ""))
        except RunFailed as exc:
            raise FileOpError(str(exc)) from None

    async def _user(self, sandbox_id: str, running: Running | None, name: str) -> users.ExecUser | None:
        """Who a command runs as: name resolved in the sandbox's own /etc/passwd and /etc/group (per
        sandbox and name, once), None for its root."""
        if name in users.ROOT_NAMES or running is None:
            return None
        if name in running.users:
            return running.users[name]
        kind = running.record.backend or kinds.CONTAINER
        if not kinds.supports(kind, "users"):
            raise RunFailed(f"a {kind} sandbox runs commands as its root only (user {name!r} asked)")
        files = []
        for path in ("/etc/passwd", "/etc/group"):
            try:
                files.append((await self.backend.read_file(sandbox_id, path, 1 << 20)).decode(errors="replace"))
            except BackendError:
                files.append("")
        who = running.users[name] = users.resolve(name, *files)
        return who

    async def timeline(self, sandbox_id: str, messages: list[tuple[str, bytes, str]], after_exit: str = "",
                       exit_subject: str = "") -> None:
        """Messages on a sandbox's timeline (an exec's trajectory record): durable now, published in its order
        (and, with after_exit, once that exec's exit record, on exit_subject, is stored)."""
        await self.records.change(None, sandbox_id, publishes=[Publish(s, d, m) for s, d, m in messages],
                                  after_exit=after_exit, exit_subject=exit_subject)

    def environment_faults(self, sandbox_id: str, since: float) -> list[str]:
        running = self.running.get(sandbox_id)
        return self.layers.faults_since([la.digest for la in running.layers], since) if running is not None else []

    def exit_stored(self, exec_id: str) -> None:
        self.records.exit_stored(exec_id)

    # ---- destroy (the op lane, the TTL loop, a stop, a node declared lost) -------------------------------

    async def destroy(self, sandbox_id: str, state: str = "destroyed", reason: str = "") -> Outcome | None:
        """Destroy a sandbox this edge runs and record why (KeyError if it does not run here). FINAL when
        its record had ended otherwise first (its node was declared lost meanwhile)."""
        running = self.running.get(sandbox_id)
        if running is None:
            raise KeyError(sandbox_id)
        if not running.ending:
            running.ending, running.ending_why = state, reason
        try:
            await self.backend.destroy(sandbox_id)
        finally:
            await self.settle(sandbox_id)   # its execs' records first, then `destroyed`
            outcome = await self.gone_now(sandbox_id, running.ending, reason)
        return outcome

    async def gone_now(self, sandbox_id: str, state: str, reason: str, wait: bool = True) -> Outcome | None:
        """The sandbox no longer runs: free it and record its final state."""
        running = self.running.pop(sandbox_id, None)
        self.released(sandbox_id)
        if running is None:
            return None
        if state == running.ending and running.ending_why:
            reason = running.ending_why   # what ended it first (a VM that died, then a destroy): one story
        self.ended[sandbox_id] = (state, reason)
        while len(self.ended) > ENDED_KEPT:
            self.ended.popitem(last=False)
        return await self.record(running, state, event=state, detail=reason, reason=reason, suspended=False,
                                 wait=wait)

    # ---- suspend and resume (client.suspend / client.resume) -----------------------------------------

    async def suspend(self, sandbox_id: str) -> None:
        """Freeze a sandbox; its TTL stops counting. Idempotent."""
        running = self.running[sandbox_id]
        async with running.freezing:
            await self._suspend(running, sandbox_id)

    async def _suspend(self, running: Running, sandbox_id: str) -> None:
        if running.suspended_since:
            return
        await self.backend.freeze(sandbox_id)
        now = time.time()
        running.suspended_since, running.suspends = now, running.suspends + 1
        self.deadlines.look(sandbox_id)
        await self.record(running, event="suspended", nth=running.suspends, suspended=True, suspended_at=now)

    async def resume(self, sandbox_id: str) -> None:
        """Thaw a suspended sandbox; its TTL moves on by the time it was suspended (one its TTL suspended,
        on_timeout="suspend", gets its TTL again: it was frozen again at once). Idempotent."""
        running = self.running[sandbox_id]
        async with running.freezing:
            if not running.suspended_since:
                return
            await self.backend.thaw(sandbox_id)
            self._unpause(running)
        self.deadlines.look(sandbox_id)
        await self.record(running, event="resumed", nth=running.suspends, suspended=False,
                          expires_at=running.expires_at or running.record.expires_at)

    @staticmethod
    def _unpause(running: Running) -> None:
        """Its expiry after a suspension: moved on by the time suspended, or its TTL from now when the TTL
        suspended it (its expiry had come)."""
        now = time.time()
        if running.expires_at and running.expires_at <= running.suspended_since and running.ttl > 0:
            running.expires_at = now + running.ttl
        elif running.expires_at:
            running.expires_at += now - running.suspended_since
        running.suspended_since = 0.0

    async def set_timeout(self, sandbox_id: str, seconds: float) -> None:
        """It expires `seconds` from now (0: at the TTL loop's next look); a suspended one's count starts
        when it is resumed (resume moves the expiry on by the time it was suspended)."""
        running = self.running[sandbox_id]
        running.expires_at = (running.suspended_since or time.time()) + max(0.0, seconds)
        running.ttl = max(0.0, seconds)
        running.timeouts += 1
        self.deadlines.look(sandbox_id)
        await self.record(running, event="timeout_set", nth=running.timeouts, detail=f"{seconds:g}s",
                          expires_at=running.expires_at)

    # ---- snapshots and rollback ------------------------------------------------------------------------

    async def snapshot(self, sandbox_id: str, tag: str, memory: bool = False) -> SnapshotRecord:
        """Pack the writable layer (processes frozen meanwhile) as a layer over the sandbox's own, store
        it (object store, by digest) and its record (KV dsec-snapshots). memory: the VM's memory too, held
        by this node's backend under the snapshot's id (edge/backends/microvm/memory.py)."""
        running = self.running[sandbox_id]
        validate.check_tag(tag)   # (the lane is open to any publisher: checked here too)
        snap_id = "snap" + secrets.token_hex(8)
        with tempfile.TemporaryDirectory(dir=self.state_dir) as tmp:
            layer_file = Path(tmp) / "snapshot.erofs"
            try:
                async with running.freezing:   # (frozen for the pack, then as it was: a suspend waits for it)
                    digest = await self.backend.pack_upper(sandbox_id, str(layer_file))
            except SnapshotTooLarge as exc:
                raise InvalidRequest(str(exc)) from exc
            size = layer_file.stat().st_size
            if not await self.bus.obj_has(streams.LAYERS_OBJ, digest):   # streamed: never whole in memory
                await self.bus.obj_put_file(streams.LAYERS_OBJ, digest, layer_file)
            own = LayerRef(name=f"snapshot-{snap_id}", version=1, digest=digest, size=size)
            self.layers.adopt(own, layer_file)   # forks and rollbacks here need no fetch
        rec = running.record
        if memory:
            async with running.freezing:   # (the save stops and starts the VM: a suspend or resume waits for it)
                await self._save_memory(sandbox_id, snap_id)
        snap = SnapshotRecord(id=snap_id, tag=tag, tenant=rec.tenant, sandbox_id=sandbox_id,
                              layers=[*running.layers, own],
                              image=rec.image, env=dict(running.spec.env) if running.spec else {},
                              cwd=(running.spec.cwd if running.spec else "") or "/",
                              user=running.spec.user if running.spec else "",
                              resources=rec.resources, labels=dict(rec.labels), size=size, created_at=time.time(),
                              memory_node=self.node if memory else "", memory_kind=rec.backend if memory else "")
        try:
            await self.bus.kv_put(streams.SNAPSHOTS_KV, subjects.record_key(rec.tenant, snap_id), snap,
                                  retry_for=record_wait())
        except BaseException:
            self.backend.drop_memory(snap_id)     # (none unless memory): nobody can name it
            raise
        if memory:
            self._memory_owner[snap_id] = rec.tenant
        running.snapshots += 1
        await self.records.change(None, sandbox_id, publishes=lifecycle(
            rec, "snapshot", node=self.node, detail=f"{snap_id} {tag}".strip(), nth=running.snapshots))
        return snap

    async def prune_memories(self) -> None:
        """Forget the memory snapshots whose snapshot record was deleted (the edge looks every
        MEMORY_PRUNE_EVERY seconds while it holds any, and before it saves another)."""
        for name in self.backend.memories():
            owner = self._memory_owner.get(name)   # None: being taken (its record is not written yet)
            if owner is not None and await self.bus.kv_get(streams.SNAPSHOTS_KV,
                                                           subjects.record_key(owner, name)) is None:
                self.backend.drop_memory(name)
                self._memory_owner.pop(name, None)
                log.info("memory snapshot %s dropped: its snapshot was deleted", name)

    async def _save_memory(self, sandbox_id: str, snap_id: str) -> None:
        """The backend keeps the VM's memory as snap_id; first it forgets those whose snapshot was deleted
        (a node holds a bounded number: DSEC_VM_MEMORY_SNAPSHOTS)."""
        await self.prune_memories()
        try:
            await self.backend.save_memory(sandbox_id, snap_id)
        except CapacityExhausted as exc:
            raise CapacityUnavailable(f"memory snapshot of {sandbox_id} refused: {exc}") from exc

    async def rollback(self, sandbox_id: str, snap: SnapshotRecord) -> None:
        """Restart the sandbox on the snapshot's layers with a fresh writable layer (same id, node,
        resources; its processes start afresh), with the snapshot's default cwd and user and its env under
        the sandbox's own, as a fork of it given that env gets them (the snapshot may be of another sandbox: a
        fork going back to where it came from keeps what it was forked with). If the restart fails the
        sandbox is gone (failed)."""
        running = self.running[sandbox_id]
        if snap.tenant != running.record.tenant:
            raise InvalidRequest(f"snapshot {snap.id} not found")
        async with running.freezing:
            await self._rollback(running, sandbox_id, snap)

    async def _rollback(self, running: Running, sandbox_id: str, snap: SnapshotRecord) -> None:
        assert running.spec is not None
        paths = await self.layers.ensure(snap.layers)          # before anything is torn down
        cwd = "" if snap.cwd == "/" else snap.cwd
        spec = dataclasses.replace(running.spec, layers=paths, env={**snap.env, **running.spec.env}, cwd=cwd,
                                   user=snap.user)
        await self.backend.destroy(sandbox_id)
        try:
            await self.backend.create(spec)
        except Exception as exc:
            await self.gone_now(sandbox_id, "failed", f"rollback to {snap.id} failed: {exc}")
            raise EnvironmentFailure(f"rollback of {sandbox_id} to {snap.id} failed: {exc}") from exc
        running.spec, running.layers, running.restarts = spec, list(snap.layers), running.restarts + 1
        if running.suspended_since:   # (restarted running: its expiry moves on as a resume's would)
            self._unpause(running)
        self.deadlines.look(sandbox_id)
        await self.record(running, event="rollback", detail=snap.id, nth=running.restarts,
                          layers=[layer.digest for layer in snap.layers], suspended=False, image=snap.image,
                          cwd=cwd, user=snap.user)


async def wait_stored(stored: asyncio.Future, sandbox_id: str, until: float = 0.0) -> Outcome | None:
    """Wait (bounded: record_wait) for a change to be stored; None if the bus did not take it in time (the
    outbox keeps trying: the change is durable already)."""
    wait = record_wait(until)
    try:
        return await asyncio.wait_for(asyncio.shield(stored), wait)
    except asyncio.TimeoutError:
        log.warning("record of %s not stored within %.0fs; kept trying from the outbox", sandbox_id, wait)
        return None


def record_wait(until: float = 0.0) -> float:
    """Seconds to wait for a record: until `until` (else the deadline of the request being answered) less
    REPLY_MARGIN, at most RECORD_WAIT_MAX; RECORD_WAIT when there is no deadline."""
    if not until:
        by, task = ANSWERING_BY.get()
        until = by if task is not None and task is asyncio.current_task() else 0.0
    if not until:
        return RECORD_WAIT
    return min(RECORD_WAIT_MAX, max(0.2, until - time.time() - REPLY_MARGIN))
