"""Control messages to one running exec on its dsec.in subject: live stdin and signals, asked until the node
answers. ExecHandle uses it for the exec it started or attached to; sb.kill_process / sb.send_stdin use it by
pid, without reading the exec's output."""
from __future__ import annotations

import asyncio
import signal as signals
import time
from typing import Awaitable, Callable

import msgspec

from bus.conn import Bus
from bus.errors import DsecError, InvalidRequest, SandboxError, from_code
from bus.execwire import ExecInput, ExecResize, ExecSignal
from bus.messages import ErrorReply, op_reply_decoder
from libdsec.ids import new_id

STDIN_PIECE = 256 << 10   # bytes of live stdin per message
CONTROL_WAIT = 5.0        # seconds one stdin/signal request waits for the node (then asked again)
NODE_GONE_AFTER = 30.0    # seconds nobody serves the node's control subject before giving up
NOT_YET = 0.02            # pause before asking again while the node has not started the exec


def stdin_bytes(data: bytes | bytearray | memoryview | str) -> bytes:
    """stdin data as bytes (str: UTF-8); InvalidRequest for anything else."""
    if isinstance(data, str):
        return data.encode()
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidRequest(f"stdin data must be bytes or str, got {type(data).__name__}")
    return bytes(data)


class ExecControls:
    """The controls of exec `exec_id` on `subject`. alive(): whether asking still makes sense (the exec's end
    not yet read); ended(): whether its exit record is stored (asked every tenth try); give_up: monotonic."""

    def __init__(self, bus: Bus, subject: str, exec_id: str, give_up: float,
                 alive: Callable[[], bool] = lambda: True,
                 ended: Callable[[], Awaitable[bool]] | None = None) -> None:
        self.bus, self.subject, self.exec_id = bus, subject, exec_id
        self.give_up = give_up
        self._alive = alive
        self._ended = ended

    async def signal(self, signal: int = signals.SIGKILL) -> bool:
        """Send signal to every process of the exec (SIGKILL: its whole tree); False when it had ended."""
        if isinstance(signal, bool) or not isinstance(signal, int) or not 0 < signal <= 64:
            raise InvalidRequest(f"signal must be 1..64, got {signal!r}")
        return await self.ask(ExecSignal(exec_id=self.exec_id, signal=int(signal))) is not None

    async def send(self, data: bytes | str, eof: bool = False) -> bool:
        """Write data to its live stdin after whatever any client sent before (eof: then close it); False
        when it ended or closed its stdin. Each piece goes under an id of its own: a retry is never written twice."""
        data = stdin_bytes(data)
        pieces = [data[off:off + STDIN_PIECE] for off in range(0, len(data), STDIN_PIECE)] or [b""]
        for i, piece in enumerate(pieces):
            last = eof and i == len(pieces) - 1
            if await self.ask(ExecInput(exec_id=self.exec_id, data=piece, eof=last, piece_id=new_id("p"))) is None:
                return False
        return True

    async def resize(self, rows: int, cols: int) -> bool:
        """Resize its terminal (an exec started on one: sb.terminal); False when it had ended."""
        if not all(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 4096 for v in (rows, cols)):
            raise InvalidRequest(f"rows and cols must be 1..4096, got {rows!r}x{cols!r}")
        return await self.ask(ExecResize(exec_id=self.exec_id, rows=rows, cols=cols)) is not None

    async def ask(self, msg: ExecInput | ExecSignal | ExecResize):
        """Send a control message until the node answers it; None when the exec is not running any
        more (or its stdin is closed). Typed errors for a refused message; SandboxError when nobody has
        served the node's control subject for NODE_GONE_AFTER seconds."""
        tries = 0
        unserved_since: float | None = None
        while self._alive() and time.monotonic() < self.give_up:
            tries += 1
            if tries % 10 == 0 and self._ended is not None and await self._ended():
                return None          # its exit record is stored: nothing runs to answer
            try:
                raw = await self.bus.request(self.subject, msg, timeout=CONTROL_WAIT)
            except DsecError:        # no answer in time (a full pipe), or the connection is moving
                await asyncio.sleep(NOT_YET)
                continue
            if raw is None:          # nobody serves the node's control subject: the edge is down
                unserved_since = unserved_since or time.monotonic()
                if time.monotonic() - unserved_since > NODE_GONE_AFTER:
                    raise SandboxError(f"exec {self.exec_id}: its node has not answered for {NODE_GONE_AFTER:.0f}s")
                await asyncio.sleep(NOT_YET * 10)
                continue
            unserved_since = None
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
            await asyncio.sleep(NOT_YET)   # not started yet, ended (its exit record tells), or busy
        return None
