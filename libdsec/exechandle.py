"""A running exec seen from the SDK: its output (lines or bytes), its end, live stdin and signals.

`sb.exec` and `sb.stream` are built on it; `sb.exec(cmd, background=True)` hands it to the caller.
Output is collected as it arrives, so `wait()` after a partial `stream()` still returns every byte.
"""
from __future__ import annotations

import asyncio
import signal as signals
import time
from typing import AsyncIterable, AsyncIterator

import msgspec

from bus import subjects
from bus.conn import Bus
from bus.errors import DsecError, ExecTimeout, InvalidRequest, from_code
from bus.messages import ErrorReply, ExecInput, ExecSignal, ExitRecord, op_reply_decoder
from libdsec.execstream import EXIT_GRACE, ExecStream, LineSplitter, exit_of
from libdsec.results import ExecResult, Exit, Output

STDIN_PIECE = 256 << 10   # bytes of live stdin per message
CONTROL_WAIT = 5.0        # seconds one stdin/signal request waits for the node (then asked again)
NOT_YET = 0.02            # pause before asking again while the node has not started the exec


class ExecHandle:
    """One exec: `stream()` yields Output per line then Exit; `wait()` returns the ExecResult;
    `kill(signal)` signals its processes. Consume its output once (stream or wait; wait may follow
    a partial stream)."""

    def __init__(self, bus: Bus, node: str, sandbox_id: str, exec_id: str, stream: ExecStream,
                 timeout: float, keep_output: bool = True) -> None:
        self.id = exec_id
        self.sandbox_id = sandbox_id
        self._bus = bus
        self._control = subjects.exec_input(node, sandbox_id, exec_id)
        self._stream = stream
        self._timeout = timeout
        self._give_up = time.monotonic() + timeout + EXIT_GRACE
        self._records = stream.records(timeout + EXIT_GRACE)
        self._keep = keep_output           # stream() alone (sb.stream) keeps only partial lines
        self._out: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        self._lines = LineSplitter()
        self._exit: ExitRecord | None = None
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

    async def stream(self) -> AsyncIterator[Output | Exit]:
        """Each line as it is produced (the last partial line at the end), then the Exit. Leaving the
        loop early keeps the handle: wait() or another stream() goes on from there; after the end,
        stream() yields the Exit again."""
        if self._exit is None:
            async for rec in self._records:
                if isinstance(rec, ExitRecord):
                    self._exit = rec
                    await self.close()
                    break
                if self._keep:
                    self._out[rec.stream].append(rec.data)
                for out in self._lines.feed(rec.stream, rec.data):
                    yield out
        for out in self._lines.flush():
            yield out
        yield self._end()

    async def wait(self) -> ExecResult:
        """Wait for the end; ExecTimeout (with the partial output) if it outlived its timeout."""
        if self._exit is None:
            try:
                async for rec in self._records:
                    if isinstance(rec, ExitRecord):
                        self._exit = rec
                        break
                    self._out[rec.stream].append(rec.data)
            finally:
                await self.close()
        ex = self._end()
        stdout, stderr = b"".join(self._out["stdout"]), b"".join(self._out["stderr"])   # one copy
        if ex.timed_out:
            raise ExecTimeout(f"command timed out after {self._timeout}s; its process tree was killed",
                              stdout=stdout, stderr=stderr, truncated=ex.truncated)
        return ExecResult(exit_code=ex.exit_code, stdout=stdout, stderr=stderr, duration=ex.duration,
                          cpu_time=ex.cpu_time, peak_memory=ex.peak_memory, timed_out=False,
                          truncated=ex.truncated, exec_id=ex.exec_id)

    def _end(self) -> Exit:
        """The Exit; the typed error of an exec that never ran, or the error of a stdin source that failed."""
        assert self._exit is not None
        if self._stdin_error is not None:
            raise self._stdin_error
        return exit_of(self._exit)

    async def kill(self, signal: int = signals.SIGKILL) -> bool:
        """Send signal to every process of the exec (SIGKILL, the default, kills its whole tree);
        False when it had already ended."""
        if not 0 < int(signal) <= 64:
            raise InvalidRequest(f"signal must be 1..64, got {signal!r}")
        reply = await self._ask(ExecSignal(exec_id=self.id, signal=int(signal)))
        return reply is not None

    async def close(self) -> None:
        """Stop listening (the exec itself runs on until it ends or is killed)."""
        if self._stdin is not None and not self._stdin.done():
            self._stdin.cancel()
        await self._stream.close()

    async def __aenter__(self) -> "ExecHandle":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ---- live stdin and signals ----------------------------------------------------------------

    async def _pump_stdin(self, source: AsyncIterable[bytes | str]) -> None:
        seq = 0
        try:
            async for item in source:
                data = item.encode() if isinstance(item, str) else bytes(item)
                for off in range(0, len(data), STDIN_PIECE):
                    seq += 1
                    if await self._ask(ExecInput(exec_id=self.id, seq=seq, data=data[off:off + STDIN_PIECE])) is None:
                        return   # the exec ended or closed its stdin: the rest has nowhere to go
        except asyncio.CancelledError:
            raise
        except Exception as exc:   # the caller's source failed: end the command's stdin, report it at the end
            self._stdin_error = exc
        await self._ask(ExecInput(exec_id=self.id, seq=seq + 1, eof=True))

    async def _ask(self, msg: ExecInput | ExecSignal):
        """Send a control message until the node answers it; None when the exec is not running any
        more (or its stdin is closed). Typed errors for a refused message."""
        tries = 0
        while not self._stream.finished and time.monotonic() < self._give_up:
            tries += 1
            if tries % 10 == 0 and await self._stream.ended():
                return None          # its exit record is stored: nothing runs to answer
            try:
                raw = await self._bus.request(self._control, msg, timeout=CONTROL_WAIT)
            except DsecError:        # no answer in time (a full pipe), or the connection is moving
                await asyncio.sleep(NOT_YET)
                continue
            if raw is None:          # nobody serves the node's control subject: the edge is down
                await asyncio.sleep(NOT_YET * 10)
                continue
            try:
                reply = op_reply_decoder.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError):
                return None
            if not isinstance(reply, ErrorReply):
                return reply
            if reply.code == "stdin_closed":
                return None
            if reply.code not in ("exec_not_running", "stdin_busy"):
                raise from_code(reply.code, reply.message)
            await asyncio.sleep(NOT_YET)   # not started yet, or ended (its exit record tells)
        return None
