"""Commands in container sandboxes: dsec-enter spawns each; its cgroups, pipes and timeout are supervised
here (execio.py)."""
from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import time
from typing import NamedTuple

from edge.backends import enter, execio, rootfiles
from edge.backends.base import BackendError, CommandNotStarted, ExecControl, ExecResult, OutputSink, SandboxGone
from edge.backends.cgroups import CallGroup, CgroupError, NodeCgroups
from edge.backends.container.state import DEFAULT_ENV, Core, Running

INIT_END_WAIT = 1.0   # seconds an exec that ended with its sandbox's init waits for that end to be told


class Collected(NamedTuple):
    """A collected command's end (see Executing.collect)."""

    result: ExecResult
    stdout: bytes
    stderr: bytes
    truncated: bool


class Executing(Core):
    """exec."""

    async def exec(self, sandbox_id: str, argv: list[str], *, env: dict[str, str], cwd: str,
                   stdin: bytes | None, timeout: float, sink: OutputSink,
                   control: ExecControl | None = None, user=None, pty: tuple[int, int] | None = None) -> ExecResult:
        """Run argv inside the sandbox (timeout <= 0: none); see ExecFailed for commands that never start.
        user: a users.ExecUser to run as (None: the sandbox's root); pty: (rows, cols) of a terminal of the
        sandbox's own devpts to run it on (its output one stream, stdout)."""
        sb = self._live(sandbox_id)
        if not argv:
            raise BackendError("empty command")
        worker = bool(sb.spec.scratch)   # one command at a time, in one group kept for all of them
        if pty is not None and worker:
            raise BackendError("a worker's calls run on no terminal")
        pipes = self._terminal(sb, pty, user) if pty is not None else execio.Pipes()
        try:
            n = 0 if worker else next(sb.execs)
            groups = self._exec_groups(sb, n)
        except BaseException:
            pipes.close()
            raise
        started = time.monotonic()
        try:
            try:
                exited = self._start_exec(sb, n, list(argv), {**DEFAULT_ENV, **sb.spec.env, **env}, cwd or "/",
                                          pipes, (",idle" if sb.spec.limits.cpu_class == "batch" else "")
                                          + (",tty" if pty is not None else "") + (user.flag() if user is not None else ""))
            finally:
                pipes.close_child_ends()    # else our copies of the write ends would hide EOF
            if control is not None:
                control.on_signal(lambda sig: self._signal(sb, groups, sig, control), after_start=True)
                if isinstance(pipes, execio.PtyPipes):
                    control.on_resize(pipes.resize)
            status, timed_out = await execio.supervise(exited, groups, pipes, stdin, timeout, sink, control,
                                                     sb.frozen_for)
            if status and not sb.init_exit.done() and execio.pid_gone(sb.init_pid):
                # its sandbox's init died and took the command with it: that end is told first (the
                # sandbox then is ending), so the exec says the sandbox failed, not an exit 137 (CI 108)
                await asyncio.wait([sb.init_exit], timeout=INIT_END_WAIT)   # (never raises, never cancels it)
            failure = execio.exec_failure(pipes.read_error(), argv, cwd)
        finally:
            pipes.close()
            cpu, peak = sb.call_group.stats() if worker and sb.call_group else NodeCgroups.exec_stats(groups)
            events = {}
            if not worker:   # a worker's group stays for its next call (its reset kills what is left)
                events = NodeCgroups.limit_events(groups)   # (v1 counts an OOM kill in the victim's group)
                if not NodeCgroups.remove(groups):   # stays if background processes remain; destroy removes it
                    sb.events.update(events)
        result = ExecResult(exit_code=execio.exit_code(status), duration=time.monotonic() - started,
                            cpu_time=cpu, peak_memory=peak, timed_out=timed_out, oom_kills=events.get("oom_kill", 0))
        if failure and not timed_out:
            raise CommandNotStarted(failure, ExecResult(-1, result.duration, cpu, peak))
        return result

    @staticmethod
    async def _signal(sb: Running, groups: dict, sig: int, control: ExecControl) -> bool:
        """Signal the exec's processes; after a SIGKILL, return once its command's pid is gone from the
        sandbox (reaped, not a zombie any more: `kill -0 PID` inside fails), at most REAP_WAIT later."""
        sent = await execio.signal_exec(groups, sig)
        if sent and sig == signal.SIGKILL and control.pid:
            await execio.reaped(f"/proc/{sb.init_pid}/root/proc/{control.pid}")
        return sent

    def _terminal(self, sb: Running, size: tuple[int, int], user) -> "execio.PtyPipes":
        """A terminal of the sandbox's own devpts (its ptmx opened inside its root, the peer by TIOCGPTPEER: no
        path the sandbox could plant), owned by whom the command runs as, sized rows x cols."""
        try:
            master, slave = rootfiles.open_pty(sb.spec.id, sb.init_pid, os.dup(sb.pidfd))
        except OSError as exc:
            raise BackendError(f"no terminal for {sb.spec.id}: {exc.strerror}") from exc
        try:
            os.fchown(slave, sb.ids.base + (user.uid if user is not None else 0), -1)
            pipes = execio.PtyPipes(master, slave)
        except BaseException:
            os.close(master)
            os.close(slave)
            raise
        pipes.resize(*size)
        return pipes

    def _exec_groups(self, sb: Running, n: int) -> dict:
        """The cgroups of exec n; a worker's one group, kept for all its calls, made at its first."""
        worker = bool(sb.spec.scratch)
        try:
            if worker and sb.call_group is not None:
                sb.call_group.reset_stats()
                return sb.call_group.groups
            groups = self._cgroups.create_exec(sb.key, n)
            if worker:   # (a failure here leaves the group to the worker's destroy, which removes its tree)
                sb.call_group = CallGroup(groups)
                sb.call_tasks = [f"{g}/tasks" for g in self._cgroups.exec_join(sb.key, n)]
            return groups
        except CgroupError as exc:
            raise BackendError(str(exc)) from exc
        except OSError as exc:
            raise BackendError(f"exec group of {sb.spec.id}: {exc}") from exc

    async def collect(self, sandbox_id: str, argv: list[str], *, env: dict[str, str], cwd: str, stdin: bytes,
                      timeout: float, max_output: int) -> Collected | None:
        """A worker's command run whole by its exec server, which keeps up to max_output bytes of each
        stream (the rest read and dropped): (ExecResult, stdout, stderr, truncated); None when the command
        does not fit one request (the caller runs it with exec). The same cgroups, timeout (its whole tree
        killed) and CommandNotStarted as exec."""
        sb = self._live(sandbox_id)
        if not sb.spec.scratch:
            raise BackendError(f"{sandbox_id} is not a worker (only a worker's calls are collected)")
        if not argv:
            raise BackendError("empty command")
        groups = self._exec_groups(sb, 0)
        started = time.monotonic()
        try:
            done = self._start_collect(sb, list(argv), {**DEFAULT_ENV, **sb.spec.env, **env}, cwd or "/",
                                       stdin, max_output)
            if done is None:
                return None
            timed_out = await execio.wait_or_kill(done, groups, timeout, sb.frozen_for)
            out = done.result()
        finally:
            cpu, peak = sb.call_group.stats() if sb.call_group else NodeCgroups.exec_stats(groups)
        result = ExecResult(exit_code=execio.exit_code(out.status), duration=time.monotonic() - started,
                            cpu_time=cpu, peak_memory=peak, timed_out=timed_out)
        failure = execio.exec_failure(out.report, argv, cwd)
        if failure and not timed_out:
            raise CommandNotStarted(failure, ExecResult(-1, result.duration, cpu, peak))
        return Collected(result, out.stdout, out.stderr, out.truncated)

    def _start_collect(self, sb: Running, argv: list[str], env: dict[str, str], cwd: str, stdin: bytes,
                       max_output: int) -> asyncio.Future | None:
        if self._spawner is None:
            raise BackendError("container backend is not started")
        with _starting(sb, argv):
            return self._via_server(sb, lambda server: server.collect(argv, env, cwd, stdin, max_output,
                                                                      fresh_ipc=True))

    def _via_server(self, sb: Running, send) -> asyncio.Future | None:
        """send(server) to the worker's exec server, a new one if it is gone (once more if it died under
        us); None when the request is too large for it (E2BIG: the caller goes another way)."""
        for again in (True, False):
            if sb.resident is None or sb.resident.closed:
                sb.resident = enter.Resident(self._spawner.helper, self._spawner.keep_mask, sb.init_pid, sb.pidfd,
                                             sb.call_tasks)
            try:
                return send(sb.resident)
            except OSError as exc:
                if exc.errno == errno.E2BIG:
                    return None
                if exc.errno != errno.EPIPE or not again:
                    raise
        return None

    def _start_exec(self, sb: Running, n: int, argv: list[str], env: dict[str, str], cwd: str,
                    pipes: "execio.Pipes", flags: str = "") -> asyncio.Future:
        """Spawn dsec-enter for the command; a future of the command's wait status (see enter.py)."""
        if self._spawner is None:
            raise BackendError("container backend is not started")
        ends = pipes.child_ends()
        tasks = sb.call_tasks or [f"{g}/tasks" for g in self._cgroups.exec_join(sb.key, n)]
        fresh_ipc = bool(sb.spec.scratch)
        with _starting(sb, argv):
            if sb.spec.scratch and not flags:   # a worker: through its own exec server (too large: one-shot)
                started = self._via_server(sb, lambda server: server.start(argv, env, cwd, ends[:3], ends[3], fresh_ipc))
                if started is not None:
                    return started
            return self._spawner.start(sb.init_pid, sb.pidfd, tasks, argv, env, cwd, ends[:3], ends[3], fresh_ipc,
                                       flags)


@contextlib.contextmanager
def _starting(sb: Running, argv: list[str]):
    """A command's start: OS errors as the backend's (the init gone: SandboxGone)."""
    try:
        yield
    except (ProcessLookupError, FileNotFoundError) as exc:   # the init is gone (or a zombie)
        raise SandboxGone(f"sandbox {sb.spec.id} is not running") from exc
    except OSError as exc:
        raise BackendError(f"cannot start {argv[0]}: {exc.strerror}") from exc
