"""Exec plumbing of the container backend: the four pipes of a command, pumping output to the sink
without reading ahead of it, feeding stdin, supervising it to its end (timeouts that do not count frozen
time, killing its tree, signals), and turning wait statuses and error reports into results."""
from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import fcntl
import signal
import struct
import subprocess
import termios
import time
from pathlib import Path

from edge.backends import cgroups
from edge.backends.base import BackendError, ExecControl, OutputSink
from edge.backends.kernel import USERNS_PER_SANDBOX

CHUNK = 64 << 10   # bytes read from a pipe at once (a pipe holds 64 KiB)
KILL_GRACE = 5.0   # after a kill, how long the pipes may take to close

class Pipes:
    """The four pipes of one exec: stdin, stdout, stderr, and the execve error pipe."""

    def __init__(self) -> None:
        self.stdin_r, self.stdin_w = os.pipe2(os.O_CLOEXEC)
        self.stdout_r, self.stdout_w = os.pipe2(os.O_CLOEXEC)
        self.stderr_r, self.stderr_w = os.pipe2(os.O_CLOEXEC)
        self.error_r, self.error_w = os.pipe2(os.O_CLOEXEC)
        for fd in (self.stdin_w, self.stdout_r, self.stderr_r, self.error_r):
            os.set_blocking(fd, False)
        self.early = b""   # read from the error pipe before the end (started_pid)

    def child_ends(self) -> list[int]:
        """The ends the command gets: stdin read, stdout write, stderr write, error write."""
        return [self.stdin_r, self.stdout_w, self.stderr_w, self.error_w]

    def close_child_ends(self) -> None:
        """Drop our copies of the child ends once the zygote has them."""
        for name in ("stdin_r", "stdout_w", "stderr_w", "error_w"):
            self.take(name)

    def take(self, name: str) -> int:
        """Hand over ownership of one fd (or close it when it is a child end)."""
        fd = getattr(self, name)
        setattr(self, name, -1)
        if name in ("stdin_r", "stdout_w", "stderr_w", "error_w") and fd >= 0:
            os.close(fd)
        return fd

    async def started_pid(self, exited: asyncio.Future) -> int:
        """The pid the command's process writes first on the error pipe (its pid in the sandbox), once it
        is there; 0 when the pipe closes or the command ends without it. What is read is kept for read_error."""
        reading = asyncio.ensure_future(wait_fd(self.error_r))
        try:
            await asyncio.wait([reading, exited], return_when=asyncio.FIRST_COMPLETED)
        finally:
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
        with contextlib.suppress(BlockingIOError):
            self.early += os.read(self.error_r, 4096)
        return split_report(self.early)[0]

    def read_error(self) -> bytes:
        """What the child wrote to the error pipe: its pid record, then a failure report if it failed."""
        try:
            return self.early + os.read(self.error_r, 4096)
        except BlockingIOError:
            return self.early

    def close(self) -> None:
        """Close every fd still open."""
        for name in ("stdin_r", "stdin_w", "stdout_r", "stdout_w", "stderr_r", "stderr_w",
                     "error_r", "error_w"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)


class PtyPipes(Pipes):
    """A terminal's: the command's stdin, stdout and stderr are the slave; its output is one stream, read
    from the master (stdout; stderr is at EOF at once), its stdin written to the master."""

    def __init__(self, master: int, slave: int) -> None:   # (no pipes of Pipes': the terminal is its stdio)
        self.error_r, self.error_w = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(self.error_r, False)
        self.stderr_r, no_stderr = os.pipe2(os.O_CLOEXEC)
        os.close(no_stderr)
        self.master = master
        os.set_blocking(master, False)
        self.stdout_r, self.stdin_w = master, os.dup(master)
        self.stdin_r, self.stdout_w, self.stderr_w = slave, os.dup(slave), os.dup(slave)
        self.early = b""

    def resize(self, rows: int, cols: int) -> None:
        """Set the terminal's size (the command gets SIGWINCH)."""
        if self.master >= 0 and self.stdout_r == self.master:
            fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def close(self) -> None:
        super().close()
        self.master = -1


async def wait_fd(fd: int, write: bool = False) -> None:
    """Return when fd is readable (or writable); the fd is unregistered before returning or raising."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    add, remove = (loop.add_writer, loop.remove_writer) if write else (loop.add_reader, loop.remove_reader)
    add(fd, lambda: fut.done() or fut.set_result(None))
    try:
        await fut
    finally:
        remove(fd)


async def exited(proc: subprocess.Popen) -> int:
    """proc's exit status, awaited on the event loop through a pidfd: a supervisor parked in proc.wait() would
    hold one of the loop's default executor threads (6 on 2 cores) for its whole life, and a few nodes'
    supervisors in one process would take them all."""
    if proc.returncode is None:
        try:
            pidfd = os.pidfd_open(proc.pid)
        except ProcessLookupError:               # gone and reaped meanwhile
            pidfd = -1
        if pidfd >= 0:
            try:
                await wait_fd(pidfd)
            finally:
                os.close(pidfd)
    return proc.wait()                           # it has exited: reaps without blocking


async def pump(fd: int, name: str, sink: OutputSink, after: asyncio.Future | None = None,
               ended: asyncio.Future | None = None) -> None:
    """Read a pipe in chunks, awaiting the sink before reading more (backpressure), until EOF, or once
    `ended` is done, what it held then (what a process the command left running writes later is not read:
    one writing all the time, `yes &`, kept it full and the exec running); from when `after` is done (the
    command's start reported)."""
    if after is not None:
        await asyncio.shield(after)
    left = -1   # bytes still to read once `ended` is done (-1: not yet)
    while True:
        if left < 0 and ended is not None and ended.done():
            left = pending_bytes(fd)
        if left == 0:
            return
        try:
            chunk = os.read(fd, CHUNK if left < 0 else min(CHUNK, left))
        except BlockingIOError:
            if ended is None:
                await wait_fd(fd)
            elif ended.done():
                return
            else:
                readable = asyncio.ensure_future(wait_fd(fd))
                try:
                    await asyncio.wait({readable, ended}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    readable.cancel()
                    await asyncio.gather(readable, return_exceptions=True)
            continue
        except OSError as exc:   # a terminal's master once every slave fd is closed
            if exc.errno == errno.EIO:
                return
            raise
        if not chunk:
            return
        if left > 0:
            left -= len(chunk)
        await sink(name, chunk)


def pending_bytes(fd: int) -> int:
    """Bytes a pipe (or terminal) holds now."""
    try:
        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
    except OSError:
        return 0


async def feed(fd: int, data: bytes) -> None:
    """Write data to the command's stdin, then close it (EOF)."""
    view = memoryview(data)
    try:
        while view:
            try:
                view = view[os.write(fd, view[:CHUNK]):]
            except BlockingIOError:
                await wait_fd(fd, write=True)
    except BrokenPipeError:
        pass        # the command stopped reading; not an error of the exec
    finally:
        os.close(fd)


async def feed_live(fd: int, first: bytes, control: ExecControl) -> None:
    """Write the request's stdin, then what arrives through control until its end (None), then close.
    Every piece taken from control is answered: True once written, False if the pipe is gone."""
    async def write(data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(fd, view[:CHUNK]):]
            except BlockingIOError:
                await wait_fd(fd, write=True)

    done: asyncio.Future | None = None
    try:
        await write(first)
        while True:
            data, done = await control.next_input()
            if data is None:
                done.set_result(True)
                return
            await write(data)
            done.set_result(True)
            done = None
    except BrokenPipeError:
        pass        # the command closed its stdin; this and later writes are answered False
    finally:
        if done is not None and not done.done():
            done.set_result(False)
        os.close(fd)
        control.close_stdin()


async def read_to_eof(fd: int) -> bytes:
    """Read a non-blocking pipe until EOF."""
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            await wait_fd(fd)
            continue
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def pid_gone(pid: int) -> bool:
    """True if pid has exited (a zombie left to another reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except OSError:
        return True


def exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def split_report(report: bytes) -> tuple[int, bytes]:
    """What a command's process wrote on its error pipe: (its pid, 0 if it wrote none; the failure report
    after it, empty once it exec'd)."""
    if report.startswith(b"pid:"):
        line, newline, rest = report.partition(b"\n")
        if newline and line[4:].isdigit():
            return int(line[4:]), rest
    return 0, report


def exec_failure(report: bytes, argv: list[str], cwd: str) -> str | None:
    """Turn the child's error report (stage, errno, text; after its pid record) into one clear line."""
    report = split_report(report)[1]
    if not report:
        return None
    stage, code, text = (report.decode(errors="replace").split("\0") + ["", ""])[:3]
    code = int(code or 0)
    if stage == "exec" and code in (errno.ENOENT, errno.ENOTDIR):
        return f"command not found: {argv[0]}"
    if stage == "exec" and code == errno.EACCES:
        return f"permission denied: {argv[0]}"
    if stage == "cwd":
        return f"no such directory: {cwd}" if code == errno.ENOENT else f"cannot enter {cwd}: {text}"
    if stage == "setup" and code == errno.ENOSPC and "user namespace" in text:
        return (f"the sandbox holds its limit of {USERNS_PER_SANDBOX} user namespaces (each exec holds one "
                f"while any of its processes lives): end some of its background processes")
    reason = text or os.strerror(code)
    return f"cannot execute {argv[0]}: {reason}" if stage == "exec" else f"exec {argv[0]} failed ({stage}): {reason}"


async def wait_unfrozen(fut: asyncio.Future, timeout: float, frozen_for) -> None:
    """Wait for fut up to timeout seconds of time not spent frozen (timeout <= 0: forever)."""
    if timeout <= 0:
        await asyncio.shield(fut)
        return
    start, frozen0 = time.monotonic(), frozen_for()
    while True:
        left = timeout - ((time.monotonic() - start) - (frozen_for() - frozen0))
        if left <= 0:
            raise asyncio.TimeoutError
        try:
            await asyncio.wait_for(asyncio.shield(fut), left)
            return
        except asyncio.TimeoutError:
            continue   # time passed while frozen does not count: look again


async def wait_or_kill(fut: asyncio.Future, groups: dict[str, Path], timeout: float, frozen_for=lambda: 0.0) -> bool:
    """Wait for an exec's fut up to timeout seconds not spent frozen; at the timeout kill its whole tree
    and give fut KILL_GRACE more (BackendError if the pipes stay open); whether it timed out. Any other
    way out (cancelled, an error) kills the tree too."""
    try:
        try:
            await wait_unfrozen(fut, timeout, frozen_for)
            return False
        except asyncio.TimeoutError:
            # killed again until it ends: a command still being started joins the group only as its helper
            # (in none of the exec's groups) lets it go, which a timeout of a few ms can come before
            give_up = time.monotonic() + KILL_GRACE
            while True:
                await kill_exec(groups)
                try:
                    await asyncio.wait_for(asyncio.shield(fut), min(0.2, max(0.0, give_up - time.monotonic())))
                    return True
                except asyncio.TimeoutError:
                    if time.monotonic() >= give_up:
                        raise BackendError("command killed but its output pipes stayed open") from None
    except BaseException:
        await asyncio.shield(kill_exec(groups))
        raise


async def supervise(exited: asyncio.Future, groups: dict[str, Path], pipes: Pipes,
                     stdin: bytes | None, timeout: float, sink: OutputSink,
                     control: ExecControl | None, frozen_for=lambda: 0.0) -> tuple[int, bool]:
    """Feed stdin, pump output, wait for exit and EOF; on timeout kill the exec's whole tree. Time
    the sandbox spends frozen (suspended) does not count against the timeout."""
    if control is not None and control.live_stdin:
        feeder = asyncio.ensure_future(feed_live(pipes.take("stdin_w"), stdin or b"", control))
    else:
        feeder = asyncio.ensure_future(feed(pipes.take("stdin_w"), stdin or b""))
    start = asyncio.ensure_future(report_start(pipes, exited, control)) if control is not None else None
    ended = exited if control is not None and control.end_on_exit else None
    pumps = [asyncio.ensure_future(pump(pipes.stdout_r, "stdout", sink, start, ended)),
             asyncio.ensure_future(pump(pipes.stderr_r, "stderr", sink, start, ended))]
    # The exit future is shared with the launcher: shield it so cancelling the gather spares it.
    everything = asyncio.gather(asyncio.shield(exited), *pumps)
    try:
        timed_out = await wait_or_kill(everything, groups, timeout, frozen_for)
        return exited.result(), timed_out
    finally:
        everything.cancel()
        if everything.done() and not everything.cancelled():
            everything.exception()      # retrieved: errors were raised above already
        tasks = [feeder, *pumps] + ([start] if start is not None else [])
        for task in tasks:
            task.cancel()
        # Wait until they unregistered their fds: the caller closes them next, and a closed
        # fd number may at once be reused by another exec's pipe.
        await asyncio.gather(*tasks, return_exceptions=True)


async def report_start(pipes: Pipes, exited: asyncio.Future, control: ExecControl) -> None:
    """Tell control the command's pid as soon as its process wrote it (before any output is read)."""
    pid = await pipes.started_pid(exited)
    if pid:
        await control.started(pid)

async def signal_exec(groups: dict[str, Path], sig: int) -> bool:
    """Signal every process of one exec (SIGKILL: the whole tree, verified gone); False when none is left.
    (The command's helper is in none of its groups: it reaps the command at once, not the host's init.)"""
    if not groups["freezer"].is_dir():
        return False
    if sig == signal.SIGKILL:
        return await cgroups.kill_tree(groups["freezer"])
    try:
        pids = cgroups.procs_under(groups["freezer"])
    except OSError:
        return False
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    return bool(pids)

REAP_WAIT = 2.0   # seconds a killed command's pid may take to be reaped (its helper's end, then the init's wait)


async def reaped(proc_path: str) -> None:
    """Wait until a process's /proc entry (in its sandbox's own /proc) is gone, at most REAP_WAIT."""
    give_up = time.monotonic() + REAP_WAIT
    while os.path.exists(proc_path) and time.monotonic() < give_up:
        await asyncio.sleep(0.005)


async def kill_exec(groups: dict[str, Path]) -> None:
    if not await cgroups.kill_tree(groups["freezer"]):
        raise BackendError(f"cannot kill the processes of {groups['freezer']}")
