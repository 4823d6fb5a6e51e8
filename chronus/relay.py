"""The output relay: a command's stdout/stderr become ordered chunks on dsec.out.<tenant>.<node>.<sandbox>.<exec>.

Output that follows a quiet spell (nothing sent for FLUSH_AFTER) goes out at once: an interactive
line costs no wait. Output that keeps coming is batched: flushed when FLUSH_BYTES are buffered or
FLUSH_AFTER seconds after the first buffered byte, never one message per line. Consecutive bytes of one stream are merged; stdout and stderr
stay apart. Every record carries the exec's sequence number (seq: both streams and the exit
record, so a reader restores the order) and its stream's own (stream_seq). A chunk is cut after
its last newline when it has one; one ending inside a line says so (partial) and the next chunk
of the stream continues that line. Past the per-exec cap, output is dropped (read at most
DRAIN_RATE bytes/s across the node's execs, so floods cost the node little and commands still end
on their own) and the exit record says truncated.

Nothing is reported stored that is not: every chunk is published into JetStream without waiting
(readers attached to the subject see it at once), and its ack is collected in a bounded window
(WINDOW_BYTES, WINDOW_CHUNKS: a full window holds the command back, as a full pipe would). A chunk
whose ack does not come (a stream leader moving, a server dying under the connection) is published
again under the same Nats-Msg-Id, so JetStream stores it once. The exit record goes out only after
every chunk before it is acked: whoever reads the exit record from DSEC_OUT can read every byte.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass

import msgspec


from bus.streams import OUT_STREAM
from bus.conn import Bus
from bus.errors import BusError
from bus.messages import encode
from bus.execwire import ExitRecord, OutputChunk, StartRecord, chunk_message, decode_output

log = logging.getLogger(__name__)

FLUSH_BYTES = 256 << 10
FLUSH_AFTER = 0.003
DRAIN_RATE = 64 << 20   # bytes/s read (and dropped) past the output cap, all of a node's execs together
TRAJ_OUTPUT = 64 << 10   # default bytes of each stream kept in the exec's trajectory record (all: dsec.out)
WINDOW_BYTES = 8 << 20   # chunk bytes published and not yet acked, at most...
WINDOW_CHUNKS = 256      # ...and chunks
ACK_WAIT = 2.0           # seconds an ack may take before the chunk is published again (same msg id)
RETRY_MAX = 5.0          # the longest pause between two tries of one record
OLD_TRY = 100.0          # past this many seconds of tries, the stream is asked first (its duplicate window is 120 s)


def exit_msg_id(exec_id: str) -> str:
    """The msg id of an exec's exit record, whoever publishes it (edge, reaper): JetStream keeps one."""
    return f"{exec_id}-exit"


@dataclass
class _Unacked:
    """A chunk published and not yet acked."""

    seq: int
    data: bytes
    headers: dict[str, str]
    ack: asyncio.Future
    sent: float          # monotonic time of its latest publish
    tries: int = 1


class OutputRelay:
    """Collects one exec's output and publishes it in order; finish() publishes the exit record."""

    def __init__(self, bus: Bus, subject: str, exec_id: str, max_output: int,
                 traj_output: int = TRAJ_OUTPUT) -> None:
        self.bus = bus
        self.subject = subject   # subjects.output(...)
        self.exec_id = exec_id
        self.max_output = max(0, max_output)
        self.seq = 0
        self.stream_seq = {"stdout": 0, "stderr": 0}
        self.total = 0
        self.truncated = False
        self._pending: list[tuple[str, bytearray]] = []
        self._pending_bytes = 0
        self._unsent = 0                      # records of _unacked never sent (sent == 0.0: a cancelled flush)
        self._timer: asyncio.TimerHandle | None = None
        self._last_flush = 0.0
        self._timed: asyncio.Future | None = None
        self._lock = asyncio.Lock()
        self._exit: ExitRecord | None = None
        self._unacked: list[_Unacked] = []    # oldest first
        self._unacked_bytes = 0
        self.republished = 0                  # chunks published again after a missing ack
        self.counts = {"stdout": 0, "stderr": 0}            # bytes relayed per stream
        self.digests = {"stdout": hashlib.sha256(), "stderr": hashlib.sha256()}
        self.kept = {"stdout": bytearray(), "stderr": bytearray()}
        self.traj_output = max(0, traj_output)
        self.pid = 0                          # as the start record said

    async def sink(self, stream: str, data: bytes) -> None:
        """Accept a chunk read from the command (the backend awaits this: backpressure)."""
        self._settle_timed()
        room = self.max_output - self.total
        if room <= 0:
            self.truncated = self.truncated or bool(data)
            await _drain_turn(len(data))   # paced, node-wide: floods past their caps cost the node little
            return
        if len(data) > room:
            data, self.truncated = data[:room], True
        self._count(stream, data)
        if self._pending and self._pending[-1][0] == stream:
            self._pending[-1][1].extend(data)
        else:
            self._pending.append((stream, bytearray(data)))
        self._pending_bytes += len(data)
        now = time.monotonic()
        if self._pending_bytes >= FLUSH_BYTES or (self._timer is None and now - self._last_flush > FLUSH_AFTER):
            await self.flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(FLUSH_AFTER, self._timed_flush)

    def _count(self, stream: str, data: bytes) -> None:
        self.total += len(data)
        self.counts[stream] += len(data)
        self.digests[stream].update(data)
        if len(self.kept[stream]) < self.traj_output:
            self.kept[stream].extend(data[:self.traj_output - len(self.kept[stream])])

    def stored_before(self, rec: OutputChunk | StartRecord) -> None:
        """Count a record an earlier run of the edge stored (an exec it left running: chronus/orphans.py)
        as if relayed here: the exit record then follows it, and the trajectory record sums it."""
        self.seq = max(self.seq, rec.seq)
        if isinstance(rec, StartRecord):
            self.pid = rec.pid
        else:
            self.stream_seq[rec.stream] = max(self.stream_seq[rec.stream], rec.stream_seq)
            self._count(rec.stream, rec.data)

    def _timed_flush(self) -> None:
        self._timer = None
        self._timed = asyncio.ensure_future(self._flush_after(self._timed))   # awaited by sink()/finish()

    async def _flush_after(self, previous: asyncio.Future | None) -> None:
        """Flush once an earlier timed flush is done; its failure surfaces here (a chain, never lost)."""
        if previous is not None:
            await previous
        await self.flush()

    def _settle_timed(self) -> None:
        """Surface the result of a timer-driven flush (a lost chunk must not pass silently)."""
        if self._timed is not None and self._timed.done():
            timed, self._timed = self._timed, None
            timed.result()

    async def flush(self) -> None:
        """Publish what is buffered, in order, in chunks of at most FLUSH_BYTES (acks collected later)."""
        async with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            pending, self._pending, self._pending_bytes = self._pending, [], 0
            self._last_flush = time.monotonic()
            todo = [(stream, piece) for stream, buf in pending for piece in pieces(buf)]
            for i, (stream, piece) in enumerate(todo):
                self.seq += 1
                self.stream_seq[stream] += 1
                data, headers = chunk_message(OutputChunk(
                    exec_id=self.exec_id, seq=self.seq, stream=stream, data=piece,
                    stream_seq=self.stream_seq[stream], partial=not piece.endswith(b"\n")))
                try:
                    await self._windowed(data, headers)
                except asyncio.CancelledError:   # what had no seq yet goes back: the next flush sends it
                    self._pending = [(st, bytearray(p)) for st, p in todo[i + 1:]] + self._pending
                    self._pending_bytes = sum(len(b) for _, b in self._pending)
                    raise
            self._reap_acked()

    def _reap_acked(self) -> None:
        """Drop chunks whose acks came in already (cheap: no waiting)."""
        while self._unacked and self._unacked[0].ack.done() and not self._unacked[0].ack.cancelled() \
                and self._unacked[0].ack.exception() is None:
            self._unacked_bytes -= len(self._unacked.pop(0).data)

    async def started(self, pid: int) -> None:
        """Publish the start record (the backend reports it before any output: it takes the next seq, 1)."""
        await self.flush()
        async with self._lock:
            self.pid = pid
            self.seq += 1
            await self._windowed(encode(StartRecord(exec_id=self.exec_id, seq=self.seq, pid=pid)), {})

    async def _windowed(self, data: bytes, headers: dict[str, str]) -> None:
        """Publish record self.seq once the window has room (under its own msg id); its ack is collected later."""
        headers["Nats-Msg-Id"] = f"{self.exec_id}.{self.seq}"
        try:
            while (len(self._unacked) >= WINDOW_CHUNKS or self._unacked_bytes >= WINDOW_BYTES
                   or self._unsent):   # one never sent goes first: seq order
                await self._settle_oldest()
            ack = await self._send(data, headers)
        except asyncio.CancelledError:   # (the bus away or slow, the pumps given up on): the record holds its
            ack = asyncio.get_running_loop().create_future()   # seq, so it is kept as not acked: finish()
            ack.set_exception(asyncio.TimeoutError())          # publishes it before the exit record (no hole)
            self._unacked.append(_Unacked(self.seq, data, headers, ack, 0.0))
            self._unacked_bytes += len(data)
            self._unsent += 1
            raise
        self._unacked.append(_Unacked(self.seq, data, headers, ack, time.monotonic()))
        self._unacked_bytes += len(data)

    async def _send(self, data: bytes, headers: dict[str, str]) -> asyncio.Future:
        """Publish one chunk (no wait for its ack); a connection that refuses even that is tried again."""
        delay = 0.05
        while True:
            try:
                return await self.bus.publish_async(self.subject, data, headers)
            except BusError as exc:
                log.debug("chunk of %s not sent (%s); again in %.2fs", self.exec_id, exc, delay)
                await asyncio.sleep(delay)
                delay = min(RETRY_MAX, delay * 2)

    async def _settle_oldest(self) -> None:
        """Wait for the oldest chunk's ack (ACK_WAIT from its publish); when it does not come, every chunk
        whose ack is as overdue is published again at once, under its own msg id (a server that died under
        the connection took all of their acks with it)."""
        u = self._unacked[0]
        while True:
            try:
                await self.bus.stored(u.ack, max(0.01, ACK_WAIT - (time.monotonic() - u.sent)))
                break
            except BusError as exc:
                log.info("chunk %d of %s not acked (%s): publishing the overdue ones again", u.seq, self.exec_id, exc)
                await self._republish_overdue()
        self._unacked.pop(0)
        self._unacked_bytes -= len(u.data)

    async def _republish_overdue(self) -> None:
        now = time.monotonic()
        for u in self._unacked:
            if u.ack.done() and not u.ack.cancelled() and u.ack.exception() is None:
                continue   # stored
            if u.ack.done() or now - u.sent >= ACK_WAIT:
                sent = await self._send(u.data, u.headers)   # (cancelled meanwhile: u keeps its old ack, not acked)
                u.ack.cancel()
                u.tries += 1
                self.republished += 1
                self._unsent -= u.sent == 0.0
                u.ack, u.sent = sent, time.monotonic()

    async def drained(self) -> None:
        """Flush, and wait until JetStream acked every chunk so far."""
        if self._timed is not None:
            timed, self._timed = self._timed, None
            await timed
        async with self._lock:   # what an interrupted flush left unsent goes before anything newer
            while self._unsent:
                await self._settle_oldest()
        await self.flush()
        async with self._lock:
            while self._unacked:
                await self._settle_oldest()

    async def finish(self, **fields) -> ExitRecord:
        """Every chunk stored (acked), then the exit record, published until stored.

        Safe to call again: the same record (same seq, same msg id) is published again."""
        await self.drained()
        if self._exit is None:
            self.seq += 1
            self._exit = ExitRecord(exec_id=self.exec_id, seq=self.seq, truncated=self.truncated, pid=self.pid, **fields)
        delay, first = 0.05, time.monotonic()
        while True:
            try:
                if time.monotonic() - first > OLD_TRY and await self._exit_is_stored():
                    return self._exit   # stored by an earlier try: past the duplicate window, never twice
                await self.bus.publish(self.subject, encode(self._exit), msg_id=exit_msg_id(self.exec_id))
                return self._exit
            except BusError as exc:
                log.warning("exit record of %s not stored (%s); again in %.2fs", self.exec_id, exc, delay)
                await asyncio.sleep(delay)
                delay = min(RETRY_MAX, delay * 2)

    async def _exit_is_stored(self) -> bool:
        last = await self.bus.last_on_subject(OUT_STREAM, self.subject, with_headers=True)
        try:
            return last is not None and isinstance(decode_output(*last), ExitRecord)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return False


_drain_free_at = 0.0   # when the node's drain budget is next free (monotonic seconds)


async def _drain_turn(size: int) -> None:
    """Wait for this many dropped bytes' turn in the node's drain budget (DRAIN_RATE shared)."""
    global _drain_free_at
    now = time.monotonic()
    _drain_free_at = max(now, _drain_free_at) + size / DRAIN_RATE
    await asyncio.sleep(_drain_free_at - now)


def pieces(buf: bytearray) -> list[bytes]:
    """Split one stream's buffered bytes into chunks of at most FLUSH_BYTES, each cut after its last
    newline when it has one (a longer line is cut at FLUSH_BYTES and continues in the next)."""
    out = []
    view = memoryview(buf)
    while len(view) > FLUSH_BYTES:
        cut = buf.rfind(b"\n", len(buf) - len(view), len(buf) - len(view) + FLUSH_BYTES) + 1
        size = cut - (len(buf) - len(view)) if cut > 0 else FLUSH_BYTES
        out.append(bytes(view[:size]))
        view = view[size:]
    if view:
        out.append(bytes(view))
    return out
