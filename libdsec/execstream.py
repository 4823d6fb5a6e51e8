"""Reading one exec's output subject: ordered by seq, gaps refilled from the stream, split into lines."""
from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

import msgspec

from bus import streams, subjects
from bus.conn import Bus
from bus.errors import BusError, SandboxError, SandboxNotFound, from_code
from bus.messages import ExitRecord, OutputChunk, decode_output, event_decoder
from libdsec.results import Exit, Output

EXIT_GRACE = 15.0   # seconds past the exec timeout before the SDK stops waiting for the node
GAP_WAIT = 1.0      # seconds a gap in the seqs may last before it is read back from the stream
GONE_GRACE = 3.0    # seconds after its sandbox's destroyed/expired event an exit record may still come


class ExecStream:
    """Subscribes before the exec is sent, so no record is missed; yields records in seq order."""

    def __init__(self, bus: Bus, sandbox_id: str, exec_id: str, tenant: str = "") -> None:
        self.bus = bus
        self.subject = subjects.output(sandbox_id, exec_id)
        self.events = subjects.event(tenant, sandbox_id) if tenant else ""
        self._queue: asyncio.Queue[tuple[bytes, dict | None] | None] = asyncio.Queue()
        self._lost = ("", "")
        self._grace: asyncio.TimerHandle | None = None
        self._paused = 0.0                   # seconds its sandbox was suspended (the deadline moves on)
        self._paused_at: float | None = None
        self._sub = None
        self._evt_sub = None
        self._held: dict[int, OutputChunk | ExitRecord] = {}
        self._next = 1
        self.finished = False   # the exit record was read, or the exec is known lost

    async def open(self) -> None:
        """Subscribe to the output subject."""
        async def _cb(data: bytes, _subject: str, headers: dict | None) -> None:
            self._queue.put_nowait((data, headers))
        self._sub = await self.bus.subscribe(self.subject, _cb, with_headers=True)
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
                elif ev.type == "node_lost":
                    self._gone("node_lost", ev.detail or "node lost")
                elif ev.type in ("destroyed", "expired") and self._grace is None:
                    # its exit record (killed with the sandbox) normally follows at once; if the node
                    # stopped before the exec even started, none ever will
                    self._grace = asyncio.get_running_loop().call_later(
                        GONE_GRACE, self._gone, ev.type, ev.detail or f"sandbox {ev.type}")
            self._evt_sub = await self.bus.subscribe(self.events, _evt)

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
        for sub in (self._sub, self._evt_sub):
            if sub is not None:
                try:
                    await sub.unsubscribe()
                except Exception:
                    pass
        self._sub = self._evt_sub = None

    async def records(self, wait: float) -> AsyncIterator[OutputChunk | ExitRecord]:
        """Records in order until the exit record; SandboxError if none comes within `wait` seconds."""
        async for rec in self._records(wait):
            if isinstance(rec, ExitRecord):
                self.finished = True
            yield rec

    async def _records(self, wait: float) -> AsyncIterator[OutputChunk | ExitRecord]:
        start = time.monotonic()

        def deadline_() -> float:   # suspended time does not count
            return start + wait + self._paused + (time.monotonic() - self._paused_at if self._paused_at else 0.0)

        while True:
            deadline = deadline_()
            try:
                data = self._queue.get_nowait()   # the common case under load: no timer, no task
            except asyncio.QueueEmpty:
                left = deadline - time.monotonic()
                timeout = max(0.05, left) if left > 0 else 0.05
                try:
                    data = await asyncio.wait_for(self._queue.get(), min(timeout, GAP_WAIT) if self._held else timeout)
                except asyncio.TimeoutError:
                    if time.monotonic() >= deadline_():
                        self.finished = True
                        raise SandboxError(f"no exit record on {self.subject} within {wait:.0f}s: node unavailable")
                    if self._held:   # a gap that did not fill itself: core delivery dropped it, the stream has it
                        await self._refill(max(self._held))
                        for out in self._in_order():
                            yield out
                            if isinstance(out, ExitRecord):
                                return
                    continue
            if data is None:
                reason, detail = self._lost
                raise SandboxNotFound(f"sandbox lost with its node: {detail}" if reason == "node_lost"
                                      else f"sandbox {reason} before the exec reported an exit: {detail}",
                                      reason=reason)
            try:
                rec = decode_output(*data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue   # junk on the subject is skipped
            if rec.seq < self._next:
                if isinstance(rec, ExitRecord):   # numbered afresh by a restarted edge: still the end
                    yield rec
                    return
                continue
            self._held[rec.seq] = rec
            if isinstance(rec, ExitRecord) and rec.seq > self._next:
                await self._refill(rec.seq)   # core delivery dropped something: the stream has it
            for out in self._in_order():
                yield out
                if isinstance(out, ExitRecord):
                    return

    def _in_order(self) -> list[OutputChunk | ExitRecord]:
        """The held records that now follow on without a gap, taken off the hold."""
        out = []
        while self._next in self._held:
            out.append(self._held.pop(self._next))
            self._next += 1
        return out

    async def ended(self) -> bool:
        """Whether the exec's exit record is stored (asked of the stream, not of this subscription)."""
        if self.finished:
            return True
        try:
            last = await self.bus.last_on_subject(streams.OUT_STREAM, self.subject, with_headers=True)
            self.finished = last is not None and isinstance(decode_output(*last), ExitRecord)
        except (BusError, msgspec.DecodeError, msgspec.ValidationError):
            pass
        return self.finished

    async def _refill(self, upto: int) -> None:
        try:
            async for data, headers in self.bus.read_subject(streams.OUT_STREAM, self.subject, with_headers=True):
                try:
                    rec = decode_output(data, headers)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    continue
                if self._next <= rec.seq <= upto:
                    self._held.setdefault(rec.seq, rec)
        except BusError:
            pass
        for seq in range(self._next, upto):
            self._held.setdefault(seq, OutputChunk(seq=seq, data=b""))   # lost past retention: keep going


def exit_of(rec: ExitRecord) -> Exit:
    """The SDK's Exit for an exit record; raises the typed error when the exec never ran."""
    if rec.error_code:
        raise from_code(rec.error_code, rec.error, reason=rec.reason or rec.error_code)
    return Exit(exit_code=rec.exit_code, duration=rec.duration, cpu_time=rec.cpu_time, peak_memory=rec.peak_memory,
                timed_out=rec.timed_out, truncated=rec.truncated, exec_id=rec.exec_id)


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
