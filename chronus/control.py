"""The exec contract between Chronus and whatever runs commands (a backend, through its node): what a
command's output is handed to, how a running command is controlled, how it ended, and why it could not run.
Backends implement it (edge/backends/base.py re-exports these); Chronus depends on nothing else of them."""
from __future__ import annotations

import asyncio
import signal as signals
from dataclasses import dataclass
from typing import Awaitable, Callable, Literal

StreamName = Literal["stdout", "stderr"]
# Called with each chunk read from a command's stdout or stderr, in the order read.
# Awaited before the next read of that stream, so a slow consumer slows the reader (no unbounded buffering).
OutputSink = Callable[[StreamName, bytes], Awaitable[None]]


@dataclass(frozen=True)
class ExecResult:
    """How one command ended."""

    exit_code: int              # 128+n when killed by signal n; -1 when it never started
    duration: float             # seconds, wall clock
    cpu_time: float             # seconds of CPU used by the command's cgroup
    peak_memory: int            # bytes, max usage of the command's cgroup
    timed_out: bool = False     # killed because the timeout passed (tree verified gone)
    oom_kills: int = 0          # its processes the kernel's OOM killer chose at the sandbox's memory limit


class ExecControl:
    """A running exec's live controls, given by the edge to Backend.exec: stdin written while the
    command runs (in order; each write resolves True once the pipe took it, False when the command's
    stdin is gone) and signals to its processes."""

    def __init__(self, live_stdin: bool = False, on_start: Callable[[int], Awaitable[None]] | None = None,
                 end_on_exit: bool = False) -> None:
        self.live_stdin = live_stdin      # stdin comes through write(), after the request's bytes
        self.end_on_exit = end_on_exit    # the exec ends when its command exits (ExecRequest.end_on_exit)
        self.pid = 0                      # the command's pid in its sandbox, once the backend said (started)
        self._started = False
        self._on_start = on_start
        self._queue: asyncio.Queue[tuple[bytes | None, asyncio.Future]] = asyncio.Queue()
        self._signal: Callable[[int], Awaitable[bool]] | None = None
        self._resize: Callable[[int, int], None] | None = None
        self.closed = False               # its stdin takes no more writes
        self.ended = False                # the exec ended: signals reach nothing
        self._early: list[int] = []       # signals sent before the command could be signalled: sent then
        self._after_start = False         # (on_signal) ... only once the command started
        self._sending: set[asyncio.Task] = set()

    def write(self, data: bytes | None) -> asyncio.Future:
        """Queue stdin bytes (None: end of stdin); the future says whether they were written."""
        fut = asyncio.get_running_loop().create_future()
        if self.closed:
            fut.set_result(False)
        else:
            self._queue.put_nowait((data, fut))
        return fut

    async def next_input(self) -> tuple[bytes | None, asyncio.Future]:
        """For the backend: the next stdin piece and its future."""
        return await self._queue.get()

    def close(self) -> None:
        """The exec ended: every queued and later write fails, and signals and resizes are refused."""
        self.ended = True
        self._early.clear()
        self._signal = None
        self._resize = None
        self.close_stdin()

    def close_stdin(self) -> None:
        """The command's stdin is gone (its end was sent, or the command closed it): every queued and later
        write fails. Its signals still reach it (a kill after close_stdin killed nothing before)."""
        self.closed = True
        while not self._queue.empty():
            _, fut = self._queue.get_nowait()
            if not fut.done():
                fut.set_result(False)

    async def started(self, pid: int) -> None:
        """For the backend: the command runs as pid (in the sandbox's pid namespace; 0: it has no process, a
        watch). Once, before any of its output reaches the sink, so its start record comes first."""
        if self._started:
            return
        self._started = True
        self.pid = max(0, pid)
        if self._after_start:
            await self._send_early()   # (before its start record, which may wait for the bus)
        if self._on_start is not None:
            await self._on_start(self.pid)

    @property
    def doomed(self) -> int:
        """SIGKILL, when one came before the command started (0: none): it need not start. (Another signal is
        sent once it can be: a command may trap it.)"""
        return signals.SIGKILL if signals.SIGKILL in self._early else 0

    def on_signal(self, fn: Callable[[int], Awaitable[bool]], after_start: bool = False) -> None:
        """For the backend: how to signal the exec's processes. Signals sent before are sent now, in order, or
        with after_start once the command started (a container's: before, its groups may still be empty)."""
        self._signal, self._after_start = fn, after_start
        if self._early and (not after_start or self._started):
            task = asyncio.ensure_future(self._send_early())
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send_early(self) -> None:
        early, self._early = self._early, []
        for sig in early:
            if self._signal is not None:
                await self._signal(sig)

    def on_resize(self, fn: Callable[[int, int], None]) -> None:
        """For the backend: how to resize the exec's terminal (rows, cols)."""
        self._resize = fn

    def resize(self, rows: int, cols: int) -> bool:
        """Resize its terminal; False when it has none (or runs no more)."""
        if self._resize is None:
            return False
        self._resize(rows, cols)
        return True

    async def signal(self, sig: int) -> bool:
        """Send sig to every process of the exec; False when it is not running any more. Before its command can
        be signalled the signal is kept, and sent once it can (on_signal): a SIGKILL a container's exec took
        before its command joined its groups found them empty, said it had killed, and the command ran (13-15
        of 40 execs cancelled within 11 ms of being sent)."""
        if self.ended:
            return False
        if self._signal is None or (self._after_start and not self._started):
            if sig not in self._early:   # (each once: a frozen sandbox's start may keep them a while)
                self._early.append(sig)
            return True
        return await self._signal(sig)


class RunFailed(Exception):
    """The command could not be run (not found, a bad cwd, the backend failing); the message is one line."""


class Gone(Exception):
    """The sandbox does not run (any more) where the command was sent."""
