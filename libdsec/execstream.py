"""Reading one exec's output subject: ordered by seq, gaps read back from the stream, split into lines.

Records arrive as core deliveries of what the edge publishes into DSEC_OUT. A delivery can be missed
(the connection moved to another server, a slow consumer), so the stream is the truth: a gap in the
seqs that lasts GAP_WAIT, a reconnect, or a quiet spell in which the stream holds something newer
than what arrived, makes the reader read the subject back from DSEC_OUT (retried through bus errors
until its deadline). What the stream does not hold (aged out) ends the read with OutputIncomplete,
never with fewer bytes passed off as the whole output.
"""
from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

import msgspec

from bus import subjects
from bus.conn import Bus
from bus.apiwire import ReadOutput, StoredOutput
from bus.errors import (AuthenticationFailed, BusError, DsecError, OutputIncomplete, SandboxError, SandboxNotFound,
                        from_code)
from bus.records import event_decoder
from bus.execwire import ExitRecord, OutputChunk, StartRecord, decode_output
from libdsec import control
from libdsec.results import Exit, Output

EXIT_GRACE = 15.0   # seconds past the exec timeout before the SDK stops waiting for the node
GAP_WAIT = 1.0      # seconds a gap in the seqs may last before it is read back from the stream
GONE_GRACE = 3.0    # seconds after its sandbox's destroyed/expired event an exit record may still come
QUIET_CHECK = 1.0   # seconds without a record before the stream is asked whether one was missed...
QUIET_CHECK_MAX = 8.0   # ...doubling up to this while the exec stays quiet
TERMINAL = ("destroyed", "expired", "failed", "node_lost")
READ_TIMEOUT = 3.0  # seconds one read of the stream (through the control API) may take before it is an error
READ_BATCH = 64     # records one read back asks for (one per request met the tenant's rate limit at 400)
_WAKE = object()    # queued on reconnect: look at the stream


class ExecStream:
    """Subscribes before the exec is sent, so no record is missed; yields records in seq order."""

    def __init__(self, bus: Bus, node: str, sandbox_id: str, exec_id: str, tenant: str, record=None) -> None:
        self.bus = bus
        self._record = record    # () -> the sandbox's record or None (asked of the control API)
        self.sandbox_id = sandbox_id
        self.tenant, self.node, self.exec_id = tenant, node, exec_id
        self.subject = subjects.output(tenant, node, sandbox_id, exec_id)
        self.events = subjects.event(tenant, sandbox_id) if tenant else ""
        self._queue: asyncio.Queue = asyncio.Queue()
        self._lost = ("", "")
        self._grace: asyncio.TimerHandle | None = None
        self._paused = 0.0                   # seconds its sandbox was suspended (the deadline moves on)
        self._paused_at: float | None = None
        self._sub = None
        self._evt_sub = None
        self._unlisten = lambda: None
        self._held: dict[int, OutputChunk | StartRecord | ExitRecord] = {}
        self._next = 1
        self._resume_at = 0     # DSEC_OUT seq up to which everything on the subject was consumed
        self._moved = False     # the connection moved since the stream was last read
        self.caught_up = 0      # times the subject was read back from the stream
        self._renumbered: ExitRecord | None = None   # an exit record numbered afresh (a restarted edge's)
        self.finished = False   # the exit record was read, or the exec is known lost

    async def open(self, replay: bool = False) -> None:
        """Subscribe to the output subject; replay: read what it already holds first (attaching to an exec
        started elsewhere: its first records were published before this subscription)."""
        if replay:
            self._on_reconnect()
        async def _cb(data: bytes, _subject: str, headers: dict | None) -> None:
            self._queue.put_nowait((data, headers))
        self._sub = await self.bus.subscribe(self.subject, _cb, with_headers=True)
        self._unlisten = self.bus.on_reconnect(self._on_reconnect)
        if self.events:   # the node dying is announced here: stop waiting for an exit it will never send
            async def _evt(data: bytes, _subject: str) -> None:
                try:
                    ev = event_decoder.decode(data)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    return
                if ev.type == "suspended" and self._paused_at is None:   # its timeout stops too
                    self._paused_at = time.monotonic()
                elif ev.type == "resumed" and self._paused_at is not None:
                    self._paused += time.monotonic() - self._paused_at
                    self._paused_at = None
                else:
                    self._ended(ev.type, ev.detail)
            self._evt_sub = await self.bus.subscribe(self.events, _evt)

    def _on_reconnect(self) -> None:
        self._moved = True
        self._queue.put_nowait(_WAKE)

    def _ended(self, state: str, detail: str) -> None:
        """Its sandbox reached a final state: node_lost ends the wait now; after destroyed/expired/failed
        its exit record (killed with the sandbox) normally follows at once, and if the node stopped
        before the exec even started, none ever will."""
        if state == "node_lost":
            self._gone("node_lost", detail or "node lost")
        elif state in TERMINAL and self._grace is None:
            self._grace = asyncio.get_running_loop().call_later(
                GONE_GRACE, self._gone, state, detail or f"sandbox {state}")

    def _gone(self, reason: str, detail: str) -> None:
        """No exit record will come: the records end with SandboxNotFound(reason)."""
        if not self.finished:
            self._lost = (reason, detail)
            self.finished = True
            self._queue.put_nowait(None)

    async def close(self) -> None:
        """Unsubscribe."""
        if self._grace is not None:
            self._grace.cancel()
        self._unlisten()
        for sub in (self._sub, self._evt_sub):
            if sub is not None:
                try:
                    await sub.unsubscribe()
                except Exception:
                    pass
        self._sub = self._evt_sub = None

    async def records(self, wait: float) -> AsyncIterator[OutputChunk | StartRecord | ExitRecord]:
        """Records in order until the exit record; SandboxError if none comes within `wait` seconds,
        OutputIncomplete if the stream no longer holds all of them."""
        async for rec in self._records(wait):
            if isinstance(rec, ExitRecord):
                self.finished = True
            yield rec

    async def _records(self, wait: float) -> AsyncIterator[OutputChunk | StartRecord | ExitRecord]:
        start = time.monotonic()
        heard, quiet = start, QUIET_CHECK
        gap_since: float | None = None

        def deadline_() -> float:   # suspended time does not count
            return start + wait + self._paused + (time.monotonic() - self._paused_at if self._paused_at else 0.0)

        while True:
            try:
                item = self._queue.get_nowait()   # the common case under load: no timer, no task
            except asyncio.QueueEmpty:
                now = time.monotonic()
                until = min(deadline_(), gap_since + GAP_WAIT if gap_since is not None else heard + quiet)
                try:
                    item = await asyncio.wait_for(self._queue.get(), max(0.01, until - now))
                except asyncio.TimeoutError:
                    self.bus.check_credential()   # revoked meanwhile: said now (it waited out the exec, then
                    now = time.monotonic()        # blamed the node: helper-40)
                    if now >= deadline_():
                        async for out in self._caught_up(now + 2.0):   # a last look before giving up
                            yield out
                            if isinstance(out, ExitRecord):
                                return
                        self.finished = True
                        raise SandboxError(f"no exit record on {self.subject} within {wait:.0f}s: node unavailable")
                    if gap_since is not None or await self._missed_some():
                        async for out in self._caught_up(deadline_()):
                            yield out
                            if isinstance(out, ExitRecord):
                                return
                        gap_since = time.monotonic() if self._held else None
                    heard, quiet = time.monotonic(), min(QUIET_CHECK_MAX, quiet * 2)
                    continue
            if item is _WAKE:
                if self._moved:
                    async for out in self._caught_up(deadline_()):
                        yield out
                        if isinstance(out, ExitRecord):
                            return
                    gap_since = time.monotonic() if self._held else None
                continue
            if item is None:   # its sandbox ended: unless the stream has the exit record after all
                async for out in self._caught_up(time.monotonic() + 2.0):
                    yield out
                    if isinstance(out, ExitRecord):
                        return
                reason, detail = self._lost
                raise SandboxNotFound(f"sandbox lost with its node: {detail}" if reason == "node_lost"
                                      else f"sandbox {reason} before the exec reported an exit: {detail}",
                                      reason=reason)
            heard, quiet = time.monotonic(), QUIET_CHECK
            try:
                rec = decode_output(*item)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue   # junk on the subject is skipped
            if rec.seq < self._next:
                if isinstance(rec, ExitRecord):   # numbered afresh by a restarted edge: still the end
                    yield rec
                    return
                continue
            self._held[rec.seq] = rec
            ready = self._in_order()
            for out in ready:
                yield out
                if isinstance(out, ExitRecord):
                    return
            if isinstance(rec, ExitRecord) and self._held:   # core delivery dropped something: the stream has it
                async for out in self._caught_up(deadline_()):
                    yield out
                    if isinstance(out, ExitRecord):
                        return
            gap_since = (gap_since or time.monotonic()) if self._held else None

    async def _caught_up(self, give_up: float) -> AsyncIterator[OutputChunk | StartRecord | ExitRecord]:
        """What reading the subject back brings, in order; then OutputIncomplete if a record is missing."""
        out, err = await self._catch_up(give_up)
        for rec in out:
            yield rec
        if err is not None:
            raise err

    def _in_order(self) -> list[OutputChunk | StartRecord | ExitRecord]:
        """The held records that now follow on without a gap, taken off the hold."""
        out = []
        while self._next in self._held:
            out.append(self._held.pop(self._next))
            self._next += 1
        return out

    async def _missed_some(self) -> bool:
        """After a quiet spell: whether the stream holds a record not delivered here. If not, the sandbox
        record tells whether the exec can still end (a destroyed or lost sandbox sends nothing more)."""
        try:
            last = await self._stored(last=True)
            if last is not None and decode_output(last.data, last.headers).seq >= self._next:
                return True
            rec = await self._record() if self._record is not None else None
        except AuthenticationFailed:
            raise
        except (BusError, msgspec.DecodeError, msgspec.ValidationError):
            return False   # asked again after the next quiet spell
        if rec is not None and rec.state in TERMINAL:
            self._ended(rec.state, rec.reason)
        return False

    async def _catch_up(self, give_up: float) -> tuple[list[OutputChunk | StartRecord | ExitRecord], OutputIncomplete | None]:
        """Read the subject back from DSEC_OUT (retried through bus errors until give_up): the records that
        now follow on, and OutputIncomplete when the exit record is known and the stream, read to its
        end, lacks some record before it."""
        self._moved, self.caught_up = False, self.caught_up + 1
        delay = 0.05
        while True:
            try:
                await self._read_back()
                break
            except AuthenticationFailed:
                raise
            except BusError as exc:
                if time.monotonic() + delay >= give_up:
                    out = self._in_order()
                    return out, (self._incomplete(f"the stream could not be read: {exc}")
                                 if self._exit_held() is not None else None)
                await asyncio.sleep(delay)
                delay = min(1.0, delay * 2)
        out = self._in_order()
        if self._exit_held() is not None:
            return out, self._incomplete("DSEC_OUT no longer holds them (aged out or purged)")
        if self._renumbered is not None and not any(isinstance(r, ExitRecord) for r in out):
            out.append(self._renumbered)   # a restarted edge's own end (numbered afresh): the end
        return out, None

    async def _read_back(self) -> None:
        seq, consumed = self._resume_at, True
        while (got := await self._stored(after=seq, batch=READ_BATCH)) is not None:
            for m in [got, *got.more]:
                seq = m.seq
                try:
                    rec = decode_output(m.data, m.headers)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    continue
                if rec.seq < self._next:
                    if isinstance(rec, ExitRecord):   # below what was read: numbered afresh
                        self._renumbered = rec
                    if consumed:
                        self._resume_at = m.seq   # everything up to here is consumed: the next read starts after
                else:
                    consumed = False
                    self._held.setdefault(rec.seq, rec)

    async def _stored(self, after: int = 0, last: bool = False, batch: int = 1) -> StoredOutput | None:
        """A record DSEC_OUT keeps on this exec's subject (the first after stream seq `after`, with up to
        batch - 1 more after it in .more; or the last), read through the control API; BusError when it cannot
        say now."""
        try:
            got = await control.ask(self.bus, self.tenant, ReadOutput(node=self.node, sandbox_id=self.sandbox_id,
                                                                      exec_id=self.exec_id, after=after, last=last,
                                                                      batch=batch),
                                    StoredOutput, timeout=READ_TIMEOUT)
        except BusError:
            raise
        except DsecError as exc:   # rate limited, or refused: this read cannot say now
            raise BusError(f"output read of {self.subject}: {exc}") from None
        return got if got.found else None

    def _exit_held(self) -> ExitRecord | None:
        exits = [r for r in self._held.values() if isinstance(r, ExitRecord)]
        return max(exits, key=lambda r: r.seq) if exits else None

    def _incomplete(self, why: str) -> OutputIncomplete:
        end = self._exit_held()
        assert end is not None
        missing = [s for s in range(self._next, end.seq) if s not in self._held]
        self.finished = True
        return OutputIncomplete(f"exec output on {self.subject} is incomplete: records {_spans(missing)} of "
                                f"{end.seq - 1} are missing ({why})", missing=missing, exit_code=end.exit_code)

    async def holds_any(self) -> bool:
        """Whether DSEC_OUT holds some record of this exec (True when it cannot say now)."""
        try:
            return await self._stored(last=True) is not None
        except BusError:
            return True

    async def ended(self) -> bool:
        """Whether the exec's exit record is stored (asked of the stream, not of this subscription)."""
        if self.finished:
            return True
        try:
            last = await self._stored(last=True)
            self.finished = last is not None and isinstance(decode_output(last.data, last.headers), ExitRecord)
        except (BusError, msgspec.DecodeError, msgspec.ValidationError):
            pass
        return self.finished


def _spans(seqs: list[int]) -> str:
    """1,2,3,7 -> '1-3, 7' (a readable list of missing seqs)."""
    out: list[str] = []
    for s in seqs:
        if out and s == int(out[-1].rsplit("-", 1)[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{s}"
        else:
            out.append(str(s))
    return ", ".join(out[:20]) + (" ..." if len(out) > 20 else "")


def exit_of(rec: ExitRecord) -> Exit:
    """The SDK's Exit for an exit record; raises the typed error when the exec never ran."""
    if rec.error_code:
        raise from_code(rec.error_code, rec.error, reason=rec.reason or rec.error_code)
    return Exit(exit_code=rec.exit_code, duration=rec.duration, cpu_time=rec.cpu_time, peak_memory=rec.peak_memory,
                timed_out=rec.timed_out, truncated=rec.truncated, exec_id=rec.exec_id, pid=rec.pid,
                failure_class=rec.failure_class, fault=rec.fault)


class LineSplitter:
    """Turns chunks of one stream into lines (the final partial line is flushed at the end). A line
    spread over many chunks is kept as pieces and joined once, when its newline comes."""

    def __init__(self) -> None:
        self._partial: dict[str, list[bytes]] = {"stdout": [], "stderr": []}

    def feed(self, stream: str, data: bytes) -> list[Output]:
        """Complete lines found so far in this stream."""
        if not data:
            return []
        pieces = self._partial[stream]
        first = data.find(b"\n")
        if first < 0:
            pieces.append(data)
            return []
        head = b"".join(pieces) + data[:first + 1] if pieces else data[:first + 1]
        pieces.clear()
        rest = data[first + 1:].split(b"\n")
        if rest[-1]:
            pieces.append(rest[-1])
        return [Output(stream, head)] + [Output(stream, line + b"\n") for line in rest[:-1]]  # type: ignore[arg-type]

    def flush(self) -> list[Output]:
        """The partial last lines, if any."""
        out = [Output(s, b"".join(p)) for s, p in self._partial.items() if p]  # type: ignore[arg-type]
        self._partial = {"stdout": [], "stderr": []}
        return out
