"""A running exec's live controls: its stdin pieces (in order, each written once however often it is sent),
signals and terminal resizes, as they reach it on dsec.in.<node>.<tenant>.<sandbox>.<exec>."""
from __future__ import annotations

import asyncio
import collections
import time

import msgspec

from bus.errors import InvalidRequest
from bus.execwire import ExecInput, ExecResize, ExecSignal, ProcessEntry, control_decoder
from bus.messages import ErrorReply, ExecRequest, OkReply
from chronus.control import ExecControl

MAX_SIGNAL = 64
MAX_PTY = 4096            # rows or columns of a terminal, at most
REMEMBERED_PIECES = 64   # piece ids of stdin sent by pid kept per exec, to answer a retry without writing again
STDIN_ANSWER_WAIT = 4.0   # a repeated stdin piece is answered within this (busy, if still not written)


class LiveExec:
    """A running exec as its control subject sees it: the backend's controls, the stdin seq and the
    request (what the sandbox's process list shows)."""

    def __init__(self, op: ExecRequest, control: ExecControl) -> None:
        self.op = op
        self.sandbox_id = op.sandbox_id
        self.tenant = op.tenant
        self.control = control
        self.started_at = time.time()
        self.next_seq = 1
        self.last: tuple[int, asyncio.Future] | None = None   # the latest stdin write, for a repeated seq
        self.appended: collections.OrderedDict[str, asyncio.Future] = collections.OrderedDict()  # by piece_id
        self.recorded = asyncio.Event()   # its exit and trajectory records are out (or given up on)

    def entry(self) -> ProcessEntry:
        op = self.op
        return ProcessEntry(exec_id=op.exec_id, pid=self.control.pid, argv=list(op.argv), shell=op.shell,
                            env=dict(op.env), cwd=op.cwd, user=op.user, started_at=self.started_at, timeout=op.timeout,
                            live_stdin=op.live_stdin, background=op.background)

async def answer(running: dict[str, LiveExec], data: bytes, subject: str):
    """The answer to a control message (stdin, a signal, a resize) for one of the running execs."""
    try:
        msg = control_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return ErrorReply(code=InvalidRequest.code, message=f"bad exec control message: {exc}")
    live = running.get(msg.exec_id)
    parts = subject.split(".")   # dsec.in.<node>.<tenant>.<sandbox>.<exec>: only its own tenant reaches it
    if live is None or parts[3:] != [live.tenant, live.sandbox_id, msg.exec_id]:
        return ErrorReply(code="exec_not_running", message=f"exec {msg.exec_id} is not running on this node")
    if isinstance(msg, ExecResize):
        if not (0 < msg.rows <= MAX_PTY and 0 < msg.cols <= MAX_PTY):
            return ErrorReply(code=InvalidRequest.code, message=f"rows and cols must be 1..{MAX_PTY}")
        if live.control.resize(msg.rows, msg.cols):
            return OkReply()
        return ErrorReply(code=InvalidRequest.code, message=f"exec {msg.exec_id} runs on no terminal")
    if isinstance(msg, ExecSignal):
        if not 0 < msg.signal <= MAX_SIGNAL:
            return ErrorReply(code=InvalidRequest.code, message=f"signal must be 1..{MAX_SIGNAL}, got {msg.signal}")
        sent = await live.control.signal(msg.signal)
        return OkReply() if sent else ErrorReply(code="exec_not_running", message="no process left to signal")
    return await _stdin(live, msg)

async def _stdin(live: LiveExec, msg: ExecInput):
    if not live.control.live_stdin:
        return ErrorReply(code=InvalidRequest.code, message="this exec was not started with a live stdin")
    if msg.seq == 0:
        return await _append(live, msg)
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
    live.last = (msg.seq, _write(live, msg))
    return await _answer_write(live.last[1])

async def _append(live: LiveExec, msg: ExecInput):
    """A piece sent by pid (seq 0): written after whatever came before; its piece_id, seen again, is
    answered as the first time (a retry), never written twice."""
    if not msg.piece_id or len(msg.piece_id) > 64:
        return ErrorReply(code=InvalidRequest.code, message="a stdin piece without seq needs a piece_id (1..64)")
    done = live.appended.get(msg.piece_id)
    if done is None:
        busy = (live.last[1] if live.last else None, next(reversed(live.appended.values()), None))
        if any(f is not None and not f.done() for f in busy):
            return ErrorReply(code="stdin_busy", message="an earlier stdin piece is still being written")
        done = live.appended[msg.piece_id] = _write(live, msg)
        if len(live.appended) > REMEMBERED_PIECES:
            live.appended.popitem(last=False)
    try:
        return await asyncio.wait_for(_answer_write(done), STDIN_ANSWER_WAIT)
    except asyncio.TimeoutError:
        return ErrorReply(code="stdin_busy", message=f"stdin piece {msg.piece_id} is still being written")

def _write(live: LiveExec, msg: ExecInput) -> asyncio.Future:
    if msg.eof:     # (its bytes first, if any: an empty write is an end of stdin to the VM agents')
        if msg.data:
            live.control.write(msg.data)
        return live.control.write(None)
    return live.control.write(msg.data)

async def _answer_write(done: asyncio.Future):
    if not await asyncio.shield(done):
        return ErrorReply(code="stdin_closed", message="the command closed its stdin")
    return OkReply()
