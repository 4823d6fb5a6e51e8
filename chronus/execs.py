"""Chronus on one node: the exec protocol.

An exec request runs at most once per exec id (redeliveries, client retries and restarts are
recognised), its output is relayed in order and stored (chronus/relay.py), and it ends in exactly
one exit record on dsec.out.<tenant>.<node>.<sandbox>.<exec> (msg id <exec>-exit, whoever publishes it). A string
command runs under the trusted shell, never a binary of the sandbox. While it runs, live stdin and
signals reach it on dsec.in.<node>.<tenant>.<sandbox>.<exec>. Its trajectory record is recorded durably (the
edge's outbox) as soon as the command ended, so the sandbox's `destroyed` comes after it on the
timeline, and goes out once its exit record is stored. An exec whose sandbox the platform destroyed
under it (a destroy, its TTL, its node declared lost) ends SandboxNotFound(reason), never as a bare kill.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Protocol

import msgspec

from bus import streams, subjects, validate
from bus.conn import Bus
from bus.errors import (DsecError, ExecFailed, InvalidRequest, RateLimited, RequestExpired, SandboxNotFound,
                        SandboxSuspended)
from bus.messages import ExecRequest, encode
from bus.records import Event, SandboxRecord, TrajRecord
from bus.execwire import ExitRecord, ProcessList, decode_output
from bus.pull import Delivery, Lease, Verdict
from chronus import liveexec, orphans
from chronus.liveexec import MAX_PTY, LiveExec
from chronus.orphans import ExecJournal, Left
from chronus.relay import TRAJ_OUTPUT, OutputRelay
from chronus.shell import command_argv
from chronus.trajfit import fit
from chronus.control import ExecControl, ExecResult, Gone, OutputSink, RunFailed

log = logging.getLogger(__name__)

REMEMBERED_EXECS = 100_000  # exec ids kept to refuse a redelivered exec
MAX_BACKGROUND_PER_EXEC_SLOT = 4   # background execs a node runs at once: this times max_execs
TENANT_SHARE = 0.75       # of those (foreground: max_execs; background: the above), what one tenant may run at once
SETTLE_WAIT = 2.0         # a destroy waits this long for its sandbox's execs to record their ends


class ExecHost(Protocol):
    """What Chronus needs of the node it runs on."""

    def record_of(self, sandbox_id: str) -> SandboxRecord | None:
        """The record of a sandbox this node runs now (None: it does not run it)."""

    def suspended(self, sandbox_id: str) -> bool:
        """Whether the sandbox is frozen (client.suspend)."""

    def ending(self, sandbox_id: str) -> str:
        """Why the platform is ending the sandbox (destroyed, expired, node_lost, failed), '' while it runs."""

    def ending_why(self, sandbox_id: str) -> str:
        """...and in words (its record's reason, e.g. what ended its VM), '' when none was given."""

    async def gone(self, sandbox_id: str, tenant: str = "") -> SandboxNotFound:
        """The typed error for a sandbox this node does not run, with the recorded reason."""

    def trusted_shell(self, sandbox_id: str) -> str:
        """The shell a sandbox's string commands run with (its backend's own)."""

    async def run(self, sandbox_id: str, argv: list[str], *, env: dict[str, str], cwd: str, stdin: bytes | None,
                  timeout: float, sink: OutputSink, control: ExecControl, user: str = "",
                  pty: tuple[int, int] | None = None) -> ExecResult:
        """Run a command in the sandbox (the backend's exec) as user ("": its default) in cwd ("": its
        default), on a terminal of pty's (rows, cols) if given: Gone when the sandbox does not run,
        RunFailed when the command could not be run."""

    async def watch(self, sandbox_id: str, path: str, recursive: bool, *, timeout: float, sink: OutputSink,
                    control: ExecControl) -> ExecResult:
        """Stream a directory's changes to sink until control's signal or the timeout; Gone / RunFailed as run."""

    async def timeline(self, sandbox_id: str, messages: list[tuple[str, bytes, str]], after_exit: str,
                       exit_subject: str) -> None:
        """Publish (subject, data, msg id) messages on the sandbox's timeline, durably and in its order,
        once the exit record of exec `after_exit` (on `exit_subject`) is stored."""

    def exit_stored(self, exec_id: str) -> None:
        """An exec's exit record is stored."""

    def environment_faults(self, sandbox_id: str, since: float) -> list[str]:
        """What failed under the sandbox since time.monotonic() `since` (its lazily loaded layers' chunks
        that could not be read): a command that failed meanwhile may have failed by it."""


@dataclass(frozen=True)
class ExecLimits:
    """A node's exec settings."""

    max_output: int = 64 << 20       # per-exec output cap, whatever a client asks for
    traj_output: int = TRAJ_OUTPUT   # bytes of each stream kept in an exec's trajectory record
    max_execs: int = 256             # concurrent execs (background ones: MAX_BACKGROUND_PER_EXEC_SLOT times)


class Execs:
    """Every exec of one node, from its request to its exit and trajectory records."""

    def __init__(self, bus: Bus, node: str, host: ExecHost, limits: ExecLimits,
                 journal: ExecJournal | None = None) -> None:
        self.bus = bus
        self.journal = journal   # running execs, for the next run after a crash (chronus/orphans.py)
        self.node = node
        self.host = host
        self.limits = limits
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.duplicates = 0   # execs delivered again and not run (ack lost, lease lost, client retry)
        self._live: dict[str, LiveExec] = {}        # running: its control subject answers
        self._recording: dict[str, LiveExec] = {}   # until its exit and trajectory records are out
        self._background: set[asyncio.Task] = set()
        self._held: collections.Counter = collections.Counter()   # (tenant, background) -> its execs running or waiting
        self._slots = asyncio.Semaphore(limits.max_execs)   # foreground execs running
        self._controls = None

    async def start(self) -> None:
        """Answer the control subject of running execs."""
        self._controls = await self.bus.serve(subjects.exec_input(self.node), self._on_control)

    async def stop(self) -> None:
        """Cancel execs in flight (their sandboxes are about to be destroyed); stop answering controls."""
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

    async def settle(self, sandbox_id: str, wait: float = SETTLE_WAIT) -> None:
        """Wait (a bounded time) until the execs of a sandbox being destroyed have recorded their ends,
        so its `destroyed` record comes after theirs on the timeline. Its watches (no process to kill with
        it) are stopped here."""
        for live in list(self._live.values()):
            if live.sandbox_id == sandbox_id and live.op.watch:
                await live.control.signal(9)
        pending = [live.recorded.wait() for live in self._recording.values() if live.sandbox_id == sandbox_id]
        if pending:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*pending), wait)

    def processes(self, sandbox_id: str, tenant: str) -> ProcessList:
        """The sandbox's execs still running, oldest first."""
        return ProcessList(processes=[live.entry() for live in self._live.values()
                                      if live.sandbox_id == sandbox_id and live.tenant == tenant and not live.op.watch])

    async def _on_control(self, data: bytes, subject: str):
        return await liveexec.answer(self._live, data, subject)

    # ---- one exec -------------------------------------------------------------------------------

    def _first_time(self, exec_id: str) -> bool:
        if exec_id in self._seen:
            return False
        self._seen[exec_id] = None
        if len(self._seen) > REMEMBERED_EXECS:
            self._seen.popitem(last=False)
        return True

    async def reject(self, tenant: str, sandbox_id: str, exec_id: str, err: DsecError) -> None:
        """The exit record of an exec that cannot run (best effort: no valid subject, nothing to answer on)."""
        with contextlib.suppress(ValueError):
            subject = subjects.output(subjects.token(tenant, "tenant"), self.node,
                                      subjects.token(sandbox_id, "sandbox_id"), subjects.token(exec_id, "exec_id"))
            relay = OutputRelay(self.bus, subject, exec_id, 0)
            await relay.finish(exit_code=-1, error_code=err.code, error=str(err),
                               reason=str(err.details.get("reason", "")))

    async def handle(self, op: ExecRequest, d: Delivery) -> Verdict:
        """An exec request from the node's op lane (the lane acks by the verdict); op.tenant is the lane
        subject's tenant, and a sandbox of another tenant is one this node does not run."""
        try:
            subjects.token(op.exec_id, "exec_id"), subjects.token(op.sandbox_id, "sandbox_id")
        except ValueError as exc:
            await self.reject(op.tenant, op.sandbox_id, op.exec_id, InvalidRequest(str(exc)))
            return Verdict.ACK
        if not self._first_time(op.exec_id) or await self._already_ran(op, d):
            self.duplicates += 1
            return Verdict.ACK   # a redelivered exec never runs twice (its exit record is stored)
        try:
            self._check(op)
            await self._runnable(op)
            if op.background and len(self._background) >= MAX_BACKGROUND_PER_EXEC_SLOT * self.limits.max_execs:
                raise ExecFailed(f"too many background execs on node {self.node} ({len(self._background)})")
            self._within_share(op)
        except DsecError as err:
            await self.reject(op.tenant, op.sandbox_id, op.exec_id, err)
            return Verdict.ACK
        held = (subjects.tenant_root(op.tenant), op.background)   # (a tenant's projects share its share)
        self._held[held] += 1
        if op.background:   # acked now: it runs on outside the lane's credit (it may run for hours)
            task = asyncio.ensure_future(self._execute(op, *self._begin(op), None))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            task.add_done_callback(lambda _t: self._release(held))   # (also one cancelled before it began)
            return Verdict.ACK
        lease = Lease(d)   # (its wait for a slot may take past the lane's ack wait)
        try:
            if not await self._slot(op):
                return Verdict.ACK
            try:
                return await self._execute(op, *self._begin(op), lease)
            finally:
                self._slots.release()
        finally:
            lease.cancel()
            self._release(held)

    async def _slot(self, op: ExecRequest) -> bool:
        """One of the node's max_execs slots, taken (the lane holds more: other ops wait their turns there);
        False when the exec was refused instead (its exit record stored): its deadline passed while it
        waited, or meanwhile its sandbox ended or was suspended."""
        try:
            left = op.deadline - time.time() if op.deadline else None
            await asyncio.wait_for(self._slots.acquire(), max(left, 0.001) if left is not None else None)
        except asyncio.TimeoutError:
            await self.reject(op.tenant, op.sandbox_id, op.exec_id, RequestExpired(
                f"exec request expired while the node's {self.limits.max_execs} exec slots were taken"))
            return False
        try:
            await self._runnable(op)
        except DsecError as err:
            self._slots.release()
            await self.reject(op.tenant, op.sandbox_id, op.exec_id, err)
            return False
        return True

    async def _runnable(self, op: ExecRequest) -> None:
        """SandboxNotFound when the node does not run the exec's sandbox for its tenant; SandboxSuspended when
        the sandbox is frozen (looked at on arrival, and again once the exec has its slot)."""
        rec = self.host.record_of(op.sandbox_id)
        if rec is None or rec.tenant != op.tenant:
            raise await self.host.gone(op.sandbox_id, op.tenant)
        if self.host.suspended(op.sandbox_id):
            raise SandboxSuspended(f"sandbox {op.sandbox_id} is suspended: resume it to run commands",
                                   reason="suspended")

    def _begin(self, op: ExecRequest) -> tuple[OutputRelay, LiveExec]:
        """The exec's output relay, and its entry as a live exec (its control subject answers from now)."""
        relay = OutputRelay(self.bus, subjects.output(op.tenant, self.node, op.sandbox_id, op.exec_id), op.exec_id,
                            min(op.max_output, self.limits.max_output), self.limits.traj_output)
        live = LiveExec(op, ExecControl(live_stdin=op.live_stdin, on_start=relay.started, end_on_exit=op.end_on_exit))
        self._live[op.exec_id] = live
        return relay, live

    def _release(self, held: tuple[str, bool]) -> None:
        self._held[held] -= 1
        if self._held[held] <= 0:
            del self._held[held]

    async def _execute(self, op: ExecRequest, relay: OutputRelay, live: LiveExec, lease: Lease | None) -> Verdict:
        rec = self.host.record_of(op.sandbox_id)
        started = time.time()
        self._recording[op.exec_id] = live
        if self.journal is not None:
            self.journal.begin(op, started)
        kept = False
        try:
            try:
                fields = await self._run(op, relay, live.control)
            finally:
                live.control.close()         # nothing more reaches it: late stdin is answered at once
                self._live.pop(op.exec_id, None)
            traj = None
            if rec is not None:   # on the timeline (durably) before anything ends the sandbox; meanwhile the
                traj = asyncio.ensure_future(self.host.timeline(   # exit record goes out
                    op.sandbox_id, self._trajectory(op, relay, fields, rec, started), after_exit=op.exec_id,
                    exit_subject=relay.subject))
                traj.add_done_callback(lambda _t: live.recorded.set())
            else:
                live.recorded.set()
            try:
                await relay.finish(**fields)     # stored, however long the bus takes
                self.host.exit_stored(op.exec_id)
            finally:
                if traj is not None:
                    await traj
            return Verdict.ACK
        except asyncio.CancelledError:   # the edge is stopping: its sandboxes are about to be destroyed
            kept = True   # (journaled: the next start records its end, if this cannot)
            with contextlib.suppress(DsecError, asyncio.TimeoutError):
                await asyncio.wait_for(relay.finish(exit_code=-1, error_code=SandboxNotFound.code, reason="destroyed",
                                                    error="sandbox destroyed: the edge stopped"), 0.5)
            raise
        finally:
            live.recorded.set()
            self._recording.pop(op.exec_id, None)
            if self.journal is not None and not kept:
                self.journal.end(op.exec_id)
            if lease is not None:
                lease.cancel()

    async def _run(self, op: ExecRequest, relay: OutputRelay, control: ExecControl) -> dict:
        """Run the command; the fields of its exit record (an error record when it could not run, or
        when the platform ended its sandbox under it)."""
        t0 = time.monotonic()
        try:
            if control.doomed:   # killed before it began: it is not started at all
                return dict(exit_code=128 + control.doomed, duration=time.monotonic() - t0)
            if op.watch:
                res = await self.host.watch(op.sandbox_id, op.watch, op.recursive, timeout=op.timeout, sink=relay.sink,
                                            control=control)
            else:
                res = await self.host.run(op.sandbox_id, command_argv(op.argv, op.shell,
                                                                      self.host.trusted_shell(op.sandbox_id)),
                                          env=dict(op.env), cwd=op.cwd, stdin=op.stdin or None, timeout=op.timeout,
                                          sink=relay.sink, control=control, user=op.user,
                                          pty=(op.pty_rows, op.pty_cols) if op.pty_rows else None)
        except Gone:
            return self._gone_fields(await self.host.gone(op.sandbox_id, op.tenant), t0)
        except RunFailed as exc:
            if self.host.ending(op.sandbox_id):
                return self._ended_fields(op.sandbox_id, t0)
            return dict(exit_code=-1, duration=time.monotonic() - t0, error_code=ExecFailed.code, error=str(exc))
        except DsecError as exc:     # the output relay lost the bus: the command was killed
            return dict(exit_code=-1, duration=time.monotonic() - t0, error_code=exc.code,
                        error=f"output relay failed: {exc}")
        except Exception as exc:     # e.g. out of fds: still exactly one outcome, an error record
            log.exception("exec %s failed", op.exec_id)
            return dict(exit_code=-1, duration=time.monotonic() - t0, error_code=ExecFailed.code,
                        error=f"exec failed on the node: {exc.__class__.__name__}: {exc}")
        if (res.exit_code != 0 or op.watch) and self.host.ending(op.sandbox_id):   # ended with its sandbox
            return self._ended_fields(op.sandbox_id, t0)
        fields = dict(exit_code=res.exit_code, duration=res.duration, cpu_time=res.cpu_time,
                      peak_memory=res.peak_memory, timed_out=res.timed_out)
        faults = self.host.environment_faults(op.sandbox_id, t0) if res.exit_code != 0 or res.timed_out else []
        if faults:   # it failed while the node failed under it: the environment's failure, not the task's
            fields.update(failure_class="environment", fault="; ".join(faults[:4])[:1000])
        elif res.oom_kills and (res.exit_code != 0 or res.timed_out):   # its own doing, said (it was a bare 137)
            fields.update(failure_class="task", fault=f"out of memory: the kernel's OOM killer killed {res.oom_kills} "
                                                      f"of its processes at the sandbox's memory limit")
        return fields

    def _ended_fields(self, sandbox_id: str, t0: float) -> dict:
        reason, why = self.host.ending(sandbox_id), self.host.ending_why(sandbox_id)
        return self._gone_fields(SandboxNotFound(f"sandbox {sandbox_id} {reason} while the command ran"
                                                 f"{': ' + why if why else ''}", reason=reason), t0)

    @staticmethod
    def _gone_fields(err: SandboxNotFound, t0: float) -> dict:
        return dict(exit_code=-1, duration=time.monotonic() - t0, error_code=err.code, error=str(err),
                    reason=err.reason)

    async def close_left(self, left: Left, rec: SandboxRecord) -> list[tuple[str, bytes, str]]:
        """An exec a dead run of this node left running: its exit record stored, its trajectory's messages."""
        return await orphans.close(self.bus, self.node, left, self.journal.last_alive(), rec, self.limits.max_output,
                                   self.limits.traj_output, self._trajectory)

    def _trajectory(self, op: ExecRequest, relay: OutputRelay, fields: dict, rec: SandboxRecord,
                    started: float, ended: float | None = None) -> list[tuple[str, bytes, str]]:
        """The exec's record on the sandbox's trajectory timeline (after its exit record: never before
        it), and a task_failed event when the command itself failed."""
        job = subjects.job_of(rec.labels)
        env_failed = fields.get("failure_class") == "environment"
        task_failed = fields.get("exit_code", 0) != 0 and not fields.get("error_code") and not env_failed
        traj = TrajRecord(
            id=op.exec_id, type="exec", sandbox_id=op.sandbox_id, tenant=rec.tenant, job=job, node=self.node,
            at=time.time(), exec_id=op.exec_id, argv=list(op.argv), shell=op.shell, cwd=op.cwd, user=op.user,
            env_keys=sorted(op.env), started_at=started, ended_at=time.time() if ended is None else ended,
            exit_code=fields.get("exit_code", 0),
            timed_out=fields.get("timed_out", False), truncated=relay.truncated,
            cpu_time=fields.get("cpu_time", 0.0), peak_memory=fields.get("peak_memory", 0),
            stdout_bytes=relay.counts["stdout"], stderr_bytes=relay.counts["stderr"],
            stdout_sha256=relay.digests["stdout"].hexdigest(), stderr_sha256=relay.digests["stderr"].hexdigest(),
            stdout=bytes(relay.kept["stdout"]), stderr=bytes(relay.kept["stderr"]),
            error_code=fields.get("error_code", ""), detail=fields.get("error", ""), background=op.background,
            live_stdin=op.live_stdin, failure_class="task" if task_failed else fields.get("failure_class", ""),
            pid=relay.pid, watch=op.watch)
        if fields.get("fault"):   # (the environment's failure, or the task's own: out of memory)
            traj = msgspec.structs.replace(traj, detail=fields.get("fault", ""))
        traj = fit(traj)
        out = [(subjects.trajectory(rec.tenant, job, op.sandbox_id), encode(traj), f"{op.exec_id}-traj")]
        if task_failed:
            out.append((subjects.event(rec.tenant, op.sandbox_id), encode(Event(
                type="task_failed", sandbox_id=op.sandbox_id, tenant=rec.tenant, node=self.node, at=time.time(),
                detail=f"exec {op.exec_id} exited {traj.exit_code}" + (f": {traj.detail}" if fields.get("fault") else ""),
                failure_class="task")), f"{op.exec_id}-failed"))
        elif env_failed:
            out.append((subjects.event(rec.tenant, op.sandbox_id), encode(Event(
                type="environment_failed", sandbox_id=op.sandbox_id, tenant=rec.tenant, node=self.node,
                at=time.time(), detail=f"exec {op.exec_id} exited {traj.exit_code}: {traj.detail}",
                failure_class="environment")), f"{op.exec_id}-failed"))
        return out

    @staticmethod
    def _check(op: ExecRequest) -> None:
        if op.watch and (op.argv or op.shell or op.stdin):
            raise InvalidRequest("a watch runs no command: no argv, shell or stdin (a live stdin takes its marks)")
        if op.watch and (not op.watch.startswith("/") or "\0" in op.watch):
            raise InvalidRequest(f"watch: an absolute path, got {op.watch!r}")
        if op.watch:
            return Execs._check_times(op)
        if op.shell and op.argv:
            raise InvalidRequest("give argv or shell, not both")
        if op.max_output <= 0:
            raise InvalidRequest(f"max_output must be a positive number of bytes, got {op.max_output}")
        if (op.pty_rows or op.pty_cols) and not (0 < op.pty_rows <= MAX_PTY and 0 < op.pty_cols <= MAX_PTY):
            raise InvalidRequest(f"a terminal's rows and cols must be 1..{MAX_PTY}, got {op.pty_rows}x{op.pty_cols}")
        if not op.shell and (not op.argv or not op.argv[0]):
            raise InvalidRequest("argv must be a non-empty list of strings, the first not empty (or give a shell "
                                 "script)")
        if "\0" in op.shell:
            raise InvalidRequest("shell script must not contain NUL bytes")
        validate.check_exec_words(op.argv, op.env, op.cwd, op.shell, op.user)
        Execs._check_times(op)

    @staticmethod
    def _check_times(op: ExecRequest) -> None:
        if not 0 < op.timeout <= validate.MAX_TTL:   # (a sandbox's longest life: no command outlives it)
            raise InvalidRequest(f"timeout must be > 0 seconds and at most {validate.MAX_TTL:.0f} (7 days), "
                                 f"got {op.timeout}")
        if op.cwd and not op.cwd.startswith("/"):
            raise InvalidRequest(f"cwd must be an absolute path, got {op.cwd!r}")
        if op.deadline and time.time() > op.deadline:
            raise RequestExpired("exec request expired before the node served it (its node was busy)")

    def _within_share(self, op: ExecRequest) -> None:
        """RateLimited past the tenant's share of the node's execs: one tenant's 256 long execs held every
        exec slot of the node (the lane's credit), and every other tenant's exec waited until it expired;
        its 1,024 background ones made every other's background exec fail (helper A2)."""
        most = self.limits.max_execs * (MAX_BACKGROUND_PER_EXEC_SLOT if op.background else 1)
        share = max(1, int(most * TENANT_SHARE))
        held = self._held[subjects.tenant_root(op.tenant), op.background]
        if held >= share:
            raise RateLimited(f"{subjects.describe(op.tenant)} runs {held} {'background ' if op.background else ''}"
                              f"execs on node {self.node}, the most one tenant may ({share} of {most}): "
                              f"wait for some to end")

    async def _already_ran(self, op: ExecRequest, d: Delivery) -> bool:
        """A redelivered exec, or one for a sandbox this node does not run (a restart recreates the lanes:
        deliveries count from 1 again), may have run before: its output subject tells."""
        if d.num_delivered <= 1 and self.host.record_of(op.sandbox_id) is not None:
            return False
        with contextlib.suppress(DsecError, msgspec.DecodeError):
            last = await self.bus.last_on_subject(
                streams.OUT_STREAM, subjects.output(op.tenant, self.node, op.sandbox_id, op.exec_id), with_headers=True)
            return last is not None and isinstance(decode_output(*last), ExitRecord)
        return False
