"""A running exec seen from the SDK: its output (lines or bytes), its end, live stdin and signals.

`sb.exec` and `sb.stream` are built on it; `sb.exec(cmd, background=True)` hands it to the caller.
One reader task owns the exec's output subscription and keeps every chunk as it arrives (until the
end, or a failure it keeps to raise again); `stream()` and `wait()` only read what it kept. So a
cancelled `wait()`, a `stream()` left early or a second `wait()` lose nothing and hang nothing.
"""
from __future__ import annotations

import asyncio
import collections
import signal as signals
import time
from typing import AsyncIterable, AsyncIterator

from bus.conn import Bus
from bus.errors import DsecError, ExecTimeout, InvalidRequest, OutputIncomplete, SandboxError, SandboxNotFound
from bus.execwire import ExecInput, ExitRecord, StartRecord
from libdsec.execcontrol import STDIN_PIECE, ExecControls
from libdsec.execstream import EXIT_GRACE, ExecStream, LineSplitter, exit_of
from libdsec.results import ExecResult, Exit, Output


class ExecHandle:
    """One exec: `stream()` yields Output per line then Exit; `wait()` returns the ExecResult;
    `kill(signal)` signals its processes. stream() may be left early and taken up again (it goes on
    where it stopped), and wait() may follow it; after the end both give the same outcome again."""

    def __init__(self, bus: Bus, control: str, sandbox_id: str, exec_id: str, stream: ExecStream,
                 timeout: float, keep_output: bool = True) -> None:
        self.id = exec_id
        self.sandbox_id = sandbox_id
        self._stream = stream
        self._timeout = timeout
        self._controls = ExecControls(bus, control, exec_id, time.monotonic() + timeout + EXIT_GRACE,
                                      alive=lambda: self._exit is None and self._error is None, ended=stream.ended)
        self._keep = keep_output     # False (sb.stream): chunks are dropped once stream() has read them
        self._chunks: list[tuple[str, bytes] | None] = []
        self._read = 0               # chunks stream() has split into lines so far
        self._lines = LineSplitter()
        self._pending: collections.deque[Output] = collections.deque()   # split, not yet yielded
        self._flushed = False
        self._exit: ExitRecord | None = None
        self._error: BaseException | None = None
        self._arrived = asyncio.Event()
        self.pid = 0                 # its pid in the sandbox, once its start record came (started())
        self.start_seen = False      # its start record came
        self._started = asyncio.Event()
        self._reader = asyncio.ensure_future(self._read_records())
        self._stdin: asyncio.Task | None = None
        self._stdin_error: BaseException | None = None

    def __repr__(self) -> str:
        return f"ExecHandle(id={self.id!r}, sandbox={self.sandbox_id!r}, done={self.done})"

    @property
    def done(self) -> bool:
        """Its exit record has been read."""
        return self._exit is not None

    def feed(self, source: AsyncIterable[bytes | str]) -> None:
        """Send source to the exec's stdin as it yields (then end of stdin), in the background."""
        self._stdin = asyncio.ensure_future(self._pump_stdin(source))

    # ---- output --------------------------------------------------------------------------------

    async def _read_records(self) -> None:
        try:
            async for rec in self._stream.records(self._timeout + EXIT_GRACE):
                if isinstance(rec, StartRecord):
                    self.pid, self.start_seen = rec.pid, True
                    self._started.set()
                    continue
                if isinstance(rec, ExitRecord):
                    self._exit = rec
                    self.pid = self.pid or rec.pid
                    return
                self._chunks.append((rec.stream, rec.data))
                self._started.set()   # output without a start record: its kind does not report pids
                self._arrived.set()
        except BaseException as exc:
            self._error = exc
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            self._arrived.set()
            self._started.set()
            if self._stdin is not None and not self._stdin.done() and self._exit is None:
                self._stdin.cancel()
            await self._stream.close()

    async def started(self) -> int:
        """Its pid in the sandbox once it started (0: its kind does not report pids). One that never ran raises
        why: SandboxNotFound when its sandbox is gone, CommandNotStarted for a missing binary, ..."""
        await self._started.wait()
        if not self.start_seen and not self._chunks:
            if self._exit is not None and self._exit.error_code:
                exit_of(self._exit)   # raises its typed error
            if self._exit is None and self._error is not None and not isinstance(self._error, asyncio.CancelledError):
                raise self._error
        return self.pid

    async def stream(self, lines: bool = True) -> AsyncIterator[Output | Exit]:
        """Each line as it is produced (the last partial line at the end), then the Exit. lines=False: each
        chunk as it arrives instead, a line not finished yet too (what a running `cat` printed so far)."""
        while True:
            while self._pending:
                yield self._pending.popleft()
            if self._read < len(self._chunks):
                name, data = self._chunks[self._read]  # type: ignore[misc]
                if not self._keep:
                    self._chunks[self._read] = None
                self._read += 1
                if lines:
                    self._pending.extend(self._lines.feed(name, data))
                else:   # what an earlier stream(lines=True) held back of a line comes first
                    self._pending.extend([o for o in self._lines.flush() if o.stream == name])
                    self._pending.append(Output(name, data))  # type: ignore[arg-type]
                continue
            if self._reader.done():
                if not self._flushed:
                    self._flushed = True
                    self._pending.extend(self._lines.flush())
                    continue
                yield self._end()
                return
            self._arrived.clear()
            if self._read == len(self._chunks) and not self._reader.done():
                await self._arrived.wait()

    async def wait(self) -> ExecResult:
        """Wait for the end; ExecTimeout (with the partial output) if it outlived its timeout."""
        await asyncio.shield(self._reader)    # a cancelled wait() leaves the reader reading
        out: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        for item in self._chunks:
            if item is not None:
                out[item[0]].append(item[1])
        stdout, stderr = b"".join(out["stdout"]), b"".join(out["stderr"])
        if isinstance(self._error, OutputIncomplete):   # what was received goes with it
            raise OutputIncomplete(self._error.message, stdout=stdout, stderr=stderr, missing=self._error.missing,
                                   **{k: v for k, v in self._error.details.items()
                                      if k not in ("stdout", "stderr", "missing")})
        try:
            ex = self._end()
        except SandboxNotFound as err:   # its sandbox ended under it: what it printed goes with the error (it
            err.details.update(stdout=stdout, stderr=stderr)   # was dropped: helper V, a VM's QEMU killed)
            raise
        if ex.timed_out:
            raise ExecTimeout(f"command timed out after {self._timeout}s; its process tree was killed"
                              + left_running(ex.exit_code), stdout=stdout, stderr=stderr, truncated=ex.truncated,
                              exit_code=ex.exit_code, exec_id=ex.exec_id)
        return ExecResult(exit_code=ex.exit_code, stdout=stdout, stderr=stderr, duration=ex.duration,
                          cpu_time=ex.cpu_time, peak_memory=ex.peak_memory, timed_out=False,
                          truncated=ex.truncated, exec_id=ex.exec_id, pid=ex.pid, failure_class=ex.failure_class,
                          fault=ex.fault)

    def _end(self) -> Exit:
        """The Exit; else the failure that ended the reading, the typed error of an exec that never ran,
        or the error of a stdin source that failed."""
        if self._error is not None:
            if isinstance(self._error, asyncio.CancelledError):
                raise SandboxError(f"exec {self.id}: its output was closed before it ended")
            raise self._error
        assert self._exit is not None
        if self._stdin_error is not None:
            raise self._stdin_error
        return exit_of(self._exit)

    async def close(self) -> None:
        """Stop listening (the exec itself runs on until it ends or is killed)."""
        tasks = (self._stdin, self._reader)
        for task in tasks:
            if task is not None and not task.done():
                task.cancel()
        await asyncio.gather(*(t for t in tasks if t is not None), return_exceptions=True)
        await self._stream.close()

    async def __aenter__(self) -> "ExecHandle":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ---- live stdin and signals ----------------------------------------------------------------

    async def kill(self, signal: int = signals.SIGKILL) -> bool:
        """Send signal to every process of the exec (SIGKILL, the default, kills its whole tree);
        False when it had already ended. SandboxError when its node does not answer for 30 s."""
        return await self._controls.signal(signal)

    async def send_stdin(self, data: bytes | str, *, eof: bool = False) -> bool:
        """Write data to its live stdin (an exec started with stdin=True, or one attached to), after whatever
        any client sent before; eof=True closes its stdin after it. False when it ended or closed its stdin."""
        return await self._controls.send(data, eof)

    async def resize(self, rows: int, cols: int) -> bool:
        """Resize its terminal (sb.terminal); False when it had ended; InvalidRequest when it has none."""
        return await self._controls.resize(rows, cols)

    async def close_stdin(self) -> bool:
        """End its live stdin (the command reads EOF); False when it had ended already."""
        return await self.send_stdin(b"", eof=True)

    async def _pump_stdin(self, source: AsyncIterable[bytes | str]) -> None:
        seq = 0
        try:
            async for item in source:
                if isinstance(item, str):
                    data = item.encode()
                elif isinstance(item, (bytes, bytearray, memoryview)):
                    data = bytes(item)
                else:
                    raise InvalidRequest(f"stdin pieces must be bytes or str, got {type(item).__name__}")
                for off in range(0, len(data), STDIN_PIECE):
                    seq += 1
                    if await self._controls.ask(ExecInput(exec_id=self.id, seq=seq,
                                                          data=data[off:off + STDIN_PIECE])) is None:
                        return   # the exec ended or closed its stdin: the rest has nowhere to go
        except asyncio.CancelledError:
            raise
        except Exception as exc:   # the caller's source failed: end the command's stdin, report it at the end
            self._stdin_error = exc
        try:
            await self._controls.ask(ExecInput(exec_id=self.id, seq=seq + 1, eof=True))
        except DsecError as exc:
            self._stdin_error = self._stdin_error or exc


def left_running(exit_code: int) -> str:
    """For a timed-out command: that it had exited by itself (any code but a SIGKILL's 137, the timeout's
    kill) and processes it left running held its output open, said; else nothing."""
    if exit_code in (137, -1):
        return ""
    return f" (the command itself had ended, exit code {exit_code}: processes it left running held its output open)"
