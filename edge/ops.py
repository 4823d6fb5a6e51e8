"""An edge's op lane: exec, destroy and file operations on the sandboxes it runs."""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from typing import TYPE_CHECKING

import msgspec

from bus import streams, subjects
from bus.errors import (DsecError, ExecFailed, FileOpError, InvalidRequest, SandboxError, SandboxNotFound,
                        SandboxSuspended)
from bus.messages import (DestroyRequest, ErrorReply, Event, ExecInput, ExecRequest, ExecSignal, ExitRecord, OkReply,
                          ReadFile, ResumeRequest, RollbackRequest, SnapshotRequest, SuspendRequest, TrajRecord,
                          WriteFile, encode, snapshot_decoder, control_decoder, decode_output, op_decoder, salvage,
                          sandbox_decoder)
from bus.pull import Delivery, Lease, Verdict
from chronus.relay import OutputRelay
from edge.backends.base import TRUSTED_SHELL, BackendError, ExecControl, SandboxGone

if TYPE_CHECKING:
    from edge.agent import Edge

log = logging.getLogger(__name__)

REMEMBERED_EXECS = 100_000  # exec ids kept to refuse a redelivered exec
MAX_SIGNAL = 64
STDIN_ANSWER_WAIT = 4.0   # a repeated stdin piece is answered within this (busy, if still not written)
MAX_BACKGROUND_PER_EXEC_SLOT = 4   # background execs a node runs at once: this times max_execs
MAX_READ = 700_000          # a reply is one message: 1 MiB max payload, base64 in JSON


class LiveExec:
    """A running exec as its control subject sees it: the backend's controls and the stdin seq."""

    def __init__(self, sandbox_id: str, control: ExecControl) -> None:
        self.sandbox_id = sandbox_id
        self.control = control
        self.next_seq = 1
        self.last: tuple[int, asyncio.Future] | None = None   # the latest stdin write, for a repeated seq
        self.recorded = asyncio.Event()   # its exit and trajectory records are out (or given up on)


class OpLane:
    """Pulls dsec.node.<node>.exec.> and runs each op; execs run concurrently up to max_execs.
    Background execs are acked once started and run on, outside that count. Running execs take live
    stdin and signals on dsec.in.<node>.<sandbox>.<exec> (core request/reply)."""

    def __init__(self, edge: "Edge") -> None:
        self.edge = edge
        self.bus = edge.bus
        self._worker = None
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.duplicates = 0   # execs delivered again and not run (ack lost, lease lost, client retry)
        self._unpublished: dict[str, tuple[OutputRelay, dict]] = {}   # exit records the bus refused so far
        self._live: dict[str, LiveExec] = {}        # running: its control subject answers
        self._recording: dict[str, LiveExec] = {}   # until its exit and trajectory records are out
        self._background: set[asyncio.Task] = set()
        self._controls = None

    async def start(self) -> None:
        """Start pulling ops and answering the control subject of running execs."""
        self._controls = await self.bus.serve(subjects.exec_input(self.edge.node), self._on_control)
        self._worker = await self.bus.pull_worker(streams.edge_ops_consumer(self.edge.node), self._handle,
                                                  credit=lambda: self.edge.config.max_execs)

    async def stop(self) -> None:
        """Stop pulling; cancel ops in flight (their sandboxes are about to be destroyed)."""
        if self._worker:
            await self._worker.stop(drain=False)
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        for live in self._live.values():   # background execs cancelled before they started
            live.control.close()
            live.recorded.set()
        self._live.clear()
        self._recording.clear()
        if self._controls is not None:
            with contextlib.suppress(Exception):
                await self._controls.unsubscribe()
            self._controls = None

    # ---- live stdin and signals ---------------------------------------------------------------

    async def _on_control(self, data: bytes, subject: str):
        try:
            msg = control_decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return ErrorReply(code=InvalidRequest.code, message=f"bad exec control message: {exc}")
        live = self._live.get(msg.exec_id)
        if live is None or subject.rsplit(".", 1)[-1] != msg.exec_id:
            return ErrorReply(code="exec_not_running", message=f"exec {msg.exec_id} is not running on this node")
        if isinstance(msg, ExecSignal):
            if not 0 < msg.signal <= MAX_SIGNAL:
                return ErrorReply(code=InvalidRequest.code, message=f"signal must be 1..{MAX_SIGNAL}, got {msg.signal}")
            sent = await live.control.signal(msg.signal)
            return OkReply() if sent else ErrorReply(code="exec_not_running", message="no process left to signal")
        return await self._stdin(live, msg)

    async def settle(self, sandbox_id: str, wait: float = 2.0) -> None:
        """Wait (a bounded time) until the execs of a sandbox being destroyed have published their exit
        and trajectory records, so its `destroyed` record comes after theirs on the timeline."""
        pending = [live.recorded.wait() for live in self._recording.values() if live.sandbox_id == sandbox_id]
        if pending:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*pending), wait)

    @staticmethod
    async def _stdin(live: LiveExec, msg: ExecInput):
        if not live.control.live_stdin:
            return ErrorReply(code=InvalidRequest.code, message="this exec was not started with a live stdin")
        if msg.seq < live.next_seq:          # a retry: the same answer as the first time (once written)
            written = True
            if live.last is not None and live.last[0] == msg.seq:
                try:       # bounded: a command that never reads must not pile up waiting answers
                    written = await asyncio.wait_for(asyncio.shield(live.last[1]), STDIN_ANSWER_WAIT)
                except asyncio.TimeoutError:
                    return ErrorReply(code="stdin_busy", message=f"stdin piece {msg.seq} is still being written")
            return OkReply() if written else ErrorReply(code="stdin_closed", message="the command closed its stdin")
        if msg.seq > live.next_seq:
            return ErrorReply(code=InvalidRequest.code, message=f"stdin piece {msg.seq} before {live.next_seq}")
        if live.last is not None and not live.last[1].done():   # one piece in flight at a time: bounded memory
            return ErrorReply(code="stdin_busy", message=f"stdin piece {live.last[0]} is still being written")
        live.next_seq += 1
        done = live.control.write(msg.data)
        if msg.eof:
            done = live.control.write(None)
        live.last = (msg.seq, done)
        if not await asyncio.shield(done):
            return ErrorReply(code="stdin_closed", message="the command closed its stdin")
        return OkReply()

    async def _handle(self, d: Delivery) -> Verdict:
        try:
            op = op_decoder.decode(d.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            env = salvage(d.data)
            await self._reply(env.reply_to, ErrorReply(request_id=env.request_id, code=InvalidRequest.code,
                                                       message=f"bad request: {exc}"))
            if env.exec_id and env.sandbox_id:
                await self._exec_error(env.sandbox_id, env.exec_id, InvalidRequest(f"bad exec request: {exc}"))
            return Verdict.TERM
        match op:
            case ExecRequest():
                return await self._exec(op, d)
            case DestroyRequest():
                await self._answer(op, self._destroy(op))
            case WriteFile():
                await self._answer(op, self._write(op))
            case ReadFile():
                await self._answer(op, self._read(op))
            case SuspendRequest():
                await self._answer(op, self._suspend(op, True))
            case ResumeRequest():
                await self._answer(op, self._suspend(op, False))
            case SnapshotRequest():
                await self._answer(op, self._snapshot(op))
            case RollbackRequest():
                await self._answer(op, self._rollback(op))
        return Verdict.ACK

    # ---- replies ------------------------------------------------------------------------------

    async def _reply(self, reply_to: str, msg) -> None:
        if subjects.is_reply_subject(reply_to):
            with contextlib.suppress(DsecError):
                await self.bus.send(reply_to, msg)

    async def _answer(self, op, work) -> None:
        try:
            if op.deadline and time.time() > op.deadline:
                work.close()
                raise InvalidRequest("request expired before the node served it")
            data = await work
            reply = OkReply(request_id=op.request_id, data=data or b"")
        except DsecError as err:
            reply = ErrorReply(request_id=op.request_id, code=err.code, message=str(err),
                               reason=str(err.details.get("reason", "")))
        except Exception as exc:   # a bug must still answer, once, and not loop through redeliveries
            log.exception("op %s on %s failed", type(op).__name__, op.sandbox_id)
            reply = ErrorReply(request_id=op.request_id, code=SandboxError.code,
                               message=f"{type(op).__name__} failed on the node: {exc.__class__.__name__}: {exc}")
        await self._reply(op.reply_to, reply)

    async def _gone(self, sandbox_id: str) -> SandboxNotFound:
        """The typed error for a sandbox this node does not run, with the reason the system recorded."""
        reason, state = "never_existed", ""
        with contextlib.suppress(DsecError):
            raw = await self.bus.kv_get(streams.SANDBOXES_KV, sandbox_id)
            if raw is not None:
                with contextlib.suppress(msgspec.DecodeError):
                    state = sandbox_decoder.decode(raw).state
                    reason = state if state != "ready" else "not_on_this_node"
        return SandboxNotFound(f"sandbox {sandbox_id} not found ({reason})", reason=reason)

    async def _require(self, sandbox_id: str) -> None:
        if sandbox_id not in self.edge.sandboxes:
            raise await self._gone(sandbox_id)

    # ---- ops ----------------------------------------------------------------------------------

    async def _destroy(self, op: DestroyRequest) -> None:
        await self._require(op.sandbox_id)
        try:
            await self.edge.destroy(op.sandbox_id, "destroyed", "destroyed by request")
        except (KeyError, SandboxGone):
            raise await self._gone(op.sandbox_id) from None
        except BackendError as exc:   # recorded as destroyed; what the kernel kept is reconciled at restart
            raise SandboxError(f"destroy of {op.sandbox_id} incomplete: {exc}") from exc

    async def _on_sandbox(self, sandbox_id: str, what: str, work):
        """Run work() for a sandbox this node runs: typed errors for a gone sandbox or a backend failure."""
        await self._require(sandbox_id)
        try:
            return await work()
        except (KeyError, SandboxGone):
            raise await self._gone(sandbox_id) from None
        except BackendError as exc:
            raise SandboxError(f"{what} of {sandbox_id} failed: {exc}") from exc

    async def _suspend(self, op: SuspendRequest | ResumeRequest, freeze: bool) -> None:
        await self._on_sandbox(op.sandbox_id, "suspend" if freeze else "resume",
                               lambda: (self.edge.suspend if freeze else self.edge.resume)(op.sandbox_id))

    async def _snapshot(self, op: SnapshotRequest) -> bytes:
        async def work() -> bytes:
            return encode(await self.edge.snapshot(op.sandbox_id, op.tag))
        return await self._on_sandbox(op.sandbox_id, "snapshot", work)

    async def _rollback(self, op: RollbackRequest) -> None:
        async def work() -> None:
            raw = await self.bus.kv_get(streams.SNAPSHOTS_KV, op.snapshot_id)
            try:
                snap = snapshot_decoder.decode(raw) if raw is not None else None
            except (msgspec.DecodeError, msgspec.ValidationError):
                snap = None
            if snap is None or snap.tenant != self.edge.sandboxes[op.sandbox_id].record.tenant:
                raise InvalidRequest(f"snapshot {op.snapshot_id} not found")
            await self.edge.rollback(op.sandbox_id, snap)
        await self._on_sandbox(op.sandbox_id, "rollback", work)

    async def _write(self, op: WriteFile) -> None:
        await self._require(op.sandbox_id)
        try:
            await self.edge.backend.write_file(op.sandbox_id, op.path, op.data, op.mode)
        except SandboxGone:
            raise await self._gone(op.sandbox_id) from None
        except BackendError as exc:
            raise FileOpError(str(exc)) from exc

    async def _read(self, op: ReadFile) -> bytes:
        await self._require(op.sandbox_id)
        if op.limit > MAX_READ:
            raise InvalidRequest(f"limit: read_file returns at most {MAX_READ} bytes per call, got {op.limit}")
        try:
            return await self.edge.backend.read_file(op.sandbox_id, op.path, op.limit)
        except SandboxGone:
            raise await self._gone(op.sandbox_id) from None
        except BackendError as exc:
            raise FileOpError(str(exc)) from exc

    # ---- exec ---------------------------------------------------------------------------------

    def _first_time(self, exec_id: str) -> bool:
        if exec_id in self._seen:
            return False
        self._seen[exec_id] = None
        if len(self._seen) > REMEMBERED_EXECS:
            self._seen.popitem(last=False)
        return True

    async def _exec_error(self, sandbox_id: str, exec_id: str, err: DsecError) -> None:
        with contextlib.suppress(ValueError):   # no valid subject to answer on
            relay = OutputRelay(self.bus, subjects.token(sandbox_id, "sandbox_id"),
                                subjects.token(exec_id, "exec_id"), 0)
            await self._final(relay, dict(exit_code=-1, error_code=err.code, error=str(err),
                                          reason=str(err.details.get("reason", ""))))   # best effort

    async def _exec(self, op: ExecRequest, d: Delivery) -> Verdict:
        try:
            subjects.token(op.exec_id, "exec_id"), subjects.token(op.sandbox_id, "sandbox_id")
        except ValueError as exc:
            await self._exec_error(op.sandbox_id, op.exec_id, InvalidRequest(str(exc)))
            return Verdict.ACK
        if op.exec_id in self._unpublished:   # it ran; only its exit record is still owed
            relay, fields = self._unpublished[op.exec_id]
            return await self._final(relay, fields)
        if not self._first_time(op.exec_id) or await self._already_ran(op, d):
            self.duplicates += 1
            return Verdict.ACK   # a redelivered exec never runs twice
        try:
            self._check_exec(op)
            await self._require(op.sandbox_id)
            if self.edge.sandboxes[op.sandbox_id].suspended_since:
                raise SandboxSuspended(f"sandbox {op.sandbox_id} is suspended: resume it to run commands",
                                       reason="suspended")
        except DsecError as err:
            await self._exec_error(op.sandbox_id, op.exec_id, err)
            return Verdict.ACK
        relay = OutputRelay(self.bus, op.sandbox_id, op.exec_id, min(op.max_output, self.edge.config.max_output),
                            self.edge.config.traj_output)
        if op.background and len(self._background) >= MAX_BACKGROUND_PER_EXEC_SLOT * self.edge.config.max_execs:
            await self._exec_error(op.sandbox_id, op.exec_id, ExecFailed(
                f"too many background execs on node {self.edge.node} ({len(self._background)})"))
            return Verdict.ACK
        live = LiveExec(op.sandbox_id, ExecControl(live_stdin=op.live_stdin))
        self._live[op.exec_id] = live
        if op.background:   # acked now: it runs on outside the lane's credit (it may run for hours)
            task = asyncio.ensure_future(self._execute(op, relay, None))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            return Verdict.ACK
        return await self._execute(op, relay, Lease(d))

    async def _execute(self, op: ExecRequest, relay: OutputRelay, lease: Lease | None) -> Verdict:
        running = self.edge.sandboxes.get(op.sandbox_id)
        started = time.time()
        live = self._live[op.exec_id]
        self._recording[op.exec_id] = live
        try:
            try:
                fields = await self._run(op, relay, live.control)
            finally:
                live.control.close()         # nothing more reaches it: late stdin is answered at once
                self._live.pop(op.exec_id, None)
            verdict = await self._final(relay, fields)
            while verdict is Verdict.NAK and lease is None:   # acked already: no redelivery will retry it
                await asyncio.sleep(1.0)
                verdict = await self._final(relay, fields)
            if verdict is Verdict.ACK and running is not None:
                await running.after_created()   # its `created` record first on the timeline
                await self._trajectory(op, relay, fields, running.record, started)
            return verdict
        except asyncio.CancelledError:   # the edge is stopping: its sandboxes are about to be destroyed
            with contextlib.suppress(DsecError, asyncio.TimeoutError):
                await asyncio.wait_for(relay.finish(exit_code=-1, error_code=SandboxNotFound.code, reason="destroyed",
                                                    error="sandbox destroyed: the edge stopped"), 0.5)
            raise
        finally:
            live.recorded.set()
            self._recording.pop(op.exec_id, None)
            if lease is not None:
                lease.cancel()

    async def _run(self, op: ExecRequest, relay: OutputRelay, control: ExecControl) -> dict:
        """Run the command; the fields of its exit record (an error record when it could not run)."""
        t0 = time.monotonic()
        try:
            argv = [TRUSTED_SHELL, "-c", op.shell] if op.shell else op.argv
            res = await self.edge.backend.exec(op.sandbox_id, argv, env=dict(op.env), cwd=op.cwd,
                                               stdin=op.stdin or None, timeout=op.timeout, sink=relay.sink,
                                               control=control)
        except SandboxGone:
            err = await self._gone(op.sandbox_id)
            return dict(exit_code=-1, error_code=err.code, error=str(err), reason=err.reason)
        except BackendError as exc:
            return dict(exit_code=-1, duration=time.monotonic() - t0, error_code=ExecFailed.code, error=str(exc))
        except DsecError as exc:     # the output relay lost the bus: the command was killed
            return dict(exit_code=-1, duration=time.monotonic() - t0, error_code=exc.code,
                        error=f"output relay failed: {exc}")
        except Exception as exc:     # e.g. out of fds: still exactly one outcome, an error record
            log.exception("exec %s failed", op.exec_id)
            return dict(exit_code=-1, duration=time.monotonic() - t0, error_code=ExecFailed.code,
                        error=f"exec failed on the node: {exc.__class__.__name__}: {exc}")
        return dict(exit_code=res.exit_code, duration=res.duration, cpu_time=res.cpu_time,
                    peak_memory=res.peak_memory, timed_out=res.timed_out)

    async def _trajectory(self, op: ExecRequest, relay: OutputRelay, fields: dict, rec, started: float) -> None:
        """The exec's record on the sandbox's trajectory timeline (after its exit record: never before it)."""
        job = subjects.job_of(rec.labels)
        task_failed = fields.get("exit_code", 0) != 0 and not fields.get("error_code")   # its own failure: never retried
        traj = TrajRecord(
            id=op.exec_id, type="exec", sandbox_id=op.sandbox_id, tenant=rec.tenant, job=job, node=self.edge.node,
            at=time.time(), exec_id=op.exec_id, argv=list(op.argv), shell=op.shell, cwd=op.cwd,
            env_keys=sorted(op.env), started_at=started, ended_at=time.time(), exit_code=fields.get("exit_code", 0),
            timed_out=fields.get("timed_out", False), truncated=relay.truncated,
            cpu_time=fields.get("cpu_time", 0.0), peak_memory=fields.get("peak_memory", 0),
            stdout_bytes=relay.counts["stdout"], stderr_bytes=relay.counts["stderr"],
            stdout_sha256=relay.digests["stdout"].hexdigest(), stderr_sha256=relay.digests["stderr"].hexdigest(),
            stdout=bytes(relay.kept["stdout"]), stderr=bytes(relay.kept["stderr"]),
            error_code=fields.get("error_code", ""), detail=fields.get("error", ""), background=op.background,
            live_stdin=op.live_stdin, failure_class="task" if task_failed else "")
        publishes = [self.bus.publish(subjects.trajectory(rec.tenant, job, op.sandbox_id), traj,
                                      msg_id=f"{op.exec_id}-traj", retries=3, retry_for=5.0)]
        if task_failed:
            publishes.append(self.bus.publish(subjects.event(rec.tenant, op.sandbox_id), Event(
                type="task_failed", sandbox_id=op.sandbox_id, tenant=rec.tenant, node=self.edge.node, at=time.time(),
                detail=f"exec {op.exec_id} exited {traj.exit_code}", failure_class="task"),
                msg_id=f"{op.exec_id}-failed", retries=3, retry_for=5.0))
        for outcome in await asyncio.gather(*publishes, return_exceptions=True):
            if isinstance(outcome, DsecError):
                log.warning("trajectory record or event of %s not published: %s", op.exec_id, outcome)
            elif isinstance(outcome, BaseException):
                raise outcome

    async def _final(self, relay: OutputRelay, fields: dict) -> Verdict:
        """Publish the exit record, the exec's one terminal outcome. Transport failures are retried
        here, then by redelivery (NAK): the record waits in memory, the command never reruns."""
        for attempt in range(3):
            try:
                await relay.finish(**fields)
                self._unpublished.pop(relay.exec_id, None)
                return Verdict.ACK
            except DsecError as exc:
                log.warning("exit record of %s not published (try %d): %s", relay.exec_id, attempt + 1, exc)
                await asyncio.sleep(0.1 * 2 ** attempt)
        self._unpublished[relay.exec_id] = (relay, fields)
        return Verdict.NAK

    @staticmethod
    def _check_exec(op: ExecRequest) -> None:
        if op.shell and op.argv:
            raise InvalidRequest("give argv or shell, not both")
        if not op.shell and (not op.argv or not all(op.argv)):
            raise InvalidRequest("argv must be a non-empty list of non-empty strings (or give a shell script)")
        if "\0" in op.shell:
            raise InvalidRequest("shell script must not contain NUL bytes")
        if not 0 < op.timeout <= 7 * 24 * 3600:
            raise InvalidRequest(f"timeout must be > 0 seconds, got {op.timeout}")
        if not op.cwd.startswith("/"):
            raise InvalidRequest(f"cwd must be an absolute path, got {op.cwd!r}")
        if op.deadline and time.time() > op.deadline:
            raise InvalidRequest("exec request expired before the node served it")

    async def _already_ran(self, op: ExecRequest, d: Delivery) -> bool:
        """After an edge restart, a redelivered exec may have run before: its output subject tells."""
        if d.num_delivered <= 1:
            return False
        with contextlib.suppress(DsecError, msgspec.DecodeError):
            last = await self.bus.last_on_subject(streams.OUT_STREAM, subjects.output(op.sandbox_id, op.exec_id),
                                                  with_headers=True)
            return last is not None and isinstance(decode_output(*last), ExitRecord)
        return False
