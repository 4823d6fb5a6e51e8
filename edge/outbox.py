"""The edge's outbox: sandbox state changes kept on disk until the bus has them.

Every change (a sandbox record to write, and the events and trajectory records that go with it) is
appended to <state dir>/outbox.log and fsynced before anyone is told of it. Changes are applied in
order per sandbox (different sandboxes in parallel) by the caller's apply(); a bus failure is
retried with capped backoff for as long as it lasts, so an outage longer than any retry window
still ends with the truth stored. Applying is idempotent (the record by compare-and-set on its
version, publishes by msg id), so a change is marked done without an fsync: after a crash the
changes not marked done are applied again at start.

The log is bounded: with MAX_PENDING changes not yet applied the edge takes no new creates (full()).
A torn or corrupt frame at start (a crash mid-write, a damaged disk) is reported, and the log is read
up to it; what was lost is reconciled from the sandbox records by the edge's start (a sandbox of
this node that no longer runs is recorded node_lost). It is compacted when it grows past COMPACT_AT.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import os
import random
import struct
import zlib
from pathlib import Path
from typing import Awaitable, Callable

import msgspec

from bus.errors import BusError
from bus.records import SandboxRecord

log = logging.getLogger(__name__)

MAX_PENDING = 20_000        # changes not yet applied past which the edge stops taking creates
COMPACT_AT = 4 << 20        # bytes of log past which it is rewritten with only what is pending
APPLYING = 64               # sandboxes whose changes are applied at once
BACKOFF_MAX = 5.0           # seconds between two tries of one change, at most
_HEAD = struct.Struct("<II")   # payload length, crc32 of the payload


class Publish(msgspec.Struct, frozen=True):
    """A message a change publishes into JetStream once its record is written (an event, a trajectory
    record), under a msg id so that publishing it again stores it once."""

    subject: str
    data: bytes
    msg_id: str


class Change(msgspec.Struct, frozen=True):
    """One state change of one sandbox."""

    sandbox_id: str
    record: SandboxRecord | None = None   # the record's new state; None: publishes only
    revision: int = -1                    # the revision it is expected over (-1: read it first)
    over_claim: bool = False              # `ready` over this node's `starting` claim: refused if the claim is gone
    terminal_event: bool = False          # the publishes are the terminal event: only if this change wrote the end
    publishes: list[Publish] = []
    at: float = 0.0
    after_exit: str = ""                  # an exec id: its exit record must be stored before the publishes
    exit_subject: str = ""                # where that exit record goes ("": a change logged before the subject had
                                          # its tenant and node tokens: dsec.out.<sandbox>.<exec>)


class _Frame(msgspec.Struct, array_like=True):
    seq: int
    change: Change | None = None          # None: the change `seq` is done


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(_Frame).decode


def frame(f: _Frame) -> bytes:
    """The bytes of one log frame."""
    payload = _encode(f)
    return _HEAD.pack(len(payload), zlib.crc32(payload)) + payload


def read_log(path: Path) -> tuple[dict[int, Change], str]:
    """The changes of a log not marked done, by seq; and a problem found reading it ('' if none)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}, ""
    pending: dict[int, Change] = {}
    off, problem = 0, ""
    while off < len(data):
        if off + _HEAD.size > len(data):
            problem = f"torn frame header at byte {off}"
            break
        size, crc = _HEAD.unpack_from(data, off)
        payload = data[off + _HEAD.size: off + _HEAD.size + size]
        if len(payload) < size:
            problem = f"torn frame at byte {off} ({len(payload)} of {size} bytes)"
            break
        if zlib.crc32(payload) != crc:
            problem = f"corrupt frame at byte {off} (checksum)"
            break
        try:
            f = _decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            problem = f"undecodable frame at byte {off}: {exc}"
            break
        if f.change is None:
            pending.pop(f.seq, None)
        else:
            pending[f.seq] = f.change
        off += _HEAD.size + size
    return pending, problem


class Outbox:
    """The durable queue of sandbox state changes of one edge."""

    def __init__(self, path: Path, apply: Callable[[Change, bool, asyncio.Future | None], Awaitable[object]],
                 max_pending: int = MAX_PENDING) -> None:
        self.path = Path(path)
        self._apply = apply            # apply(change, replayed, early) -> outcome; BusError: try again later
        self.max_pending = max_pending
        self._seq = 0
        self._fd = -1
        self._size = 0
        self._torn = False      # a failed write could not be taken back: the next write rewrites the log first
        self._io = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dsec-outbox")
        self._frames: list[tuple[bytes, asyncio.Future | None, tuple | None]] = []   # (bytes, written, job)
        self._live_bytes = 0           # bytes of the pending changes' frames (what a compaction keeps)
        self._sizes: dict[int, int] = {}
        self._closed = False
        self._writer: asyncio.Task | None = None
        self._queues: dict[str, collections.deque] = {}
        self._workers: dict[str, asyncio.Task] = {}
        self._slots = asyncio.Semaphore(APPLYING)
        self._pending: dict[int, Change] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self.problem = ""              # what was wrong with the log found at start
        self.applied = 0
        self.retries = 0

    # ---- lifecycle --------------------------------------------------------------------------------

    async def open(self) -> list[Change]:
        """Read the log a crashed (or stopped) run left, keep only its pending changes, and queue them to
        be applied again (in their order). Returns them."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        loop = asyncio.get_running_loop()
        pending, self.problem = await loop.run_in_executor(self._io, read_log, self.path)
        if self.problem:
            log.error("outbox %s: %s; read up to there, the rest is reconciled from the sandbox records",
                      self.path, self.problem)
        self._seq = max(pending, default=0)
        await loop.run_in_executor(self._io, self._rewrite, dict(pending))
        changes = []
        for seq in sorted(pending):
            self._sizes[seq] = len(frame(_Frame(seq, pending[seq])))
            self._live_bytes += self._sizes[seq]
            self._queue(seq, pending[seq], None, replayed=True)
            changes.append(pending[seq])
        return changes

    async def close(self, drain: float = 0.0) -> None:
        """Wait up to `drain` seconds for what is pending to be applied, then stop (the rest stays in the
        log for the next start)."""
        if drain > 0 and self._pending:
            try:
                await asyncio.wait_for(self._idle.wait(), drain)
            except asyncio.TimeoutError:
                log.warning("outbox: %d changes not applied yet; kept for the next start", len(self._pending))
        self._closed = True
        for task in list(self._workers.values()):
            task.cancel()
        await asyncio.gather(*self._workers.values(), return_exceptions=True)
        if self._frames:   # done markers not written yet
            self._kick()
        if self._writer is not None:
            with contextlib.suppress(Exception):
                await self._writer
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            await asyncio.get_running_loop().run_in_executor(self._io, os.close, fd)
        self._io.shutdown(wait=True)

    # ---- the caller's side ------------------------------------------------------------------------

    def full(self) -> bool:
        """Whether so many changes wait that the edge must take no new creates."""
        return len(self._pending) >= self.max_pending

    @property
    def pending(self) -> int:
        """Changes not applied yet."""
        return len(self._pending)

    def busy(self, sandbox_id: str) -> bool:
        """Whether changes of this sandbox wait to be applied."""
        return bool(self._queues.get(sandbox_id))

    async def put(self, change: Change, early: asyncio.Future | None = None) -> asyncio.Future:
        """Append a change and fsync it; returns a future of its outcome (what apply() returned), which
        resolves once it is applied, however long the bus takes. `early`, if given, is handed to apply()
        (which may resolve it sooner, e.g. once the record part is stored). OSError if the disk fails."""
        if self._closed:
            raise OSError(f"outbox {self.path} is closed")
        self._seq += 1
        seq = self._seq
        loop = asyncio.get_running_loop()
        written, outcome = loop.create_future(), loop.create_future()
        data = frame(_Frame(seq, change))
        self._pending[seq] = change    # from now on every compaction keeps it, written or about to be
        self._sizes[seq] = len(data)
        self._live_bytes += len(data)
        self._idle.clear()
        self._frames.append((data, written, (seq, change, outcome, early)))
        self._kick()
        await asyncio.shield(written)  # a caller cancelled meanwhile does not undo the change: it is queued
        return outcome

    # ---- applying ---------------------------------------------------------------------------------

    def _queue(self, seq: int, change: Change, outcome: asyncio.Future | None, early: asyncio.Future | None = None,
               replayed: bool = False) -> None:
        self._pending[seq] = change
        self._idle.clear()
        q = self._queues.setdefault(change.sandbox_id, collections.deque())
        q.append((seq, change, outcome, early, replayed))
        if change.sandbox_id not in self._workers:
            self._workers[change.sandbox_id] = asyncio.ensure_future(self._work(change.sandbox_id))

    async def _work(self, sandbox_id: str) -> None:
        q = self._queues[sandbox_id]
        try:
            async with self._slots:
                while q and not self._closed:
                    seq, change, outcome, early, replayed = q[0]
                    result = await self._apply_until_done(change, replayed, early)
                    q.popleft()
                    self._done(seq)
                    for fut in (early, outcome):
                        if fut is not None and not fut.done():
                            fut.set_result(result)
        finally:
            self._workers.pop(sandbox_id, None)
            if not q:
                self._queues.pop(sandbox_id, None)
            elif not self._closed:   # (a worker ends only by close or a bug: never leave a queue unworked)
                self._workers[sandbox_id] = asyncio.ensure_future(self._work(sandbox_id))

    async def _apply_until_done(self, change: Change, replayed: bool, early: asyncio.Future | None) -> object:
        delay = 0.05
        while True:
            try:
                return await self._apply(change, replayed, early)
            except BusError as exc:
                self.retries += 1
                log.info("outbox: change of %s not applied yet (%s); again in %.1fs", change.sandbox_id, exc, delay)
            except Exception:   # a bug: kept and tried again (slowly), never lost, never spinning
                self.retries += 1
                log.exception("outbox: change of %s failed; again in %.1fs", change.sandbox_id, delay)
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(BACKOFF_MAX, delay * 2)

    def _done(self, seq: int) -> None:
        self._pending.pop(seq, None)
        self._live_bytes -= self._sizes.pop(seq, 0)
        self.applied += 1
        # written with the next batch (no write of its own, no fsync): applying again is harmless
        self._frames.append((frame(_Frame(seq)), None, None))
        if not self._pending:
            self._idle.set()

    # ---- the log file -----------------------------------------------------------------------------

    def _kick(self) -> None:
        if self._writer is None or self._writer.done():
            self._writer = asyncio.ensure_future(self._write())

    async def _write(self) -> None:
        """Group commit: whatever was appended meanwhile goes out in one write and one fsync; then its
        changes are queued to be applied."""
        loop = asyncio.get_running_loop()
        while self._frames:
            batch, self._frames = self._frames, []
            sync = any(f is not None for _, f, _ in batch)
            data = b"".join(b for b, _, _ in batch)
            # Compact when the log is mostly done frames: a snapshot of what is pending now (changes of this
            # batch included: put() registers them first), taken on the loop; this batch follows it.
            compact = (dict(self._pending) if self._torn or self._size + len(data) > max(COMPACT_AT, 2 * self._live_bytes)
                       else None)
            try:
                await loop.run_in_executor(self._io, self._append, data, sync, compact)
            except Exception as exc:   # the disk (or the executor, at close) failed: nothing is reported
                failure = exc if isinstance(exc, OSError) else OSError(f"outbox write failed: {exc}")
                for _, written, job in batch:
                    if job is not None:
                        self._pending.pop(job[0], None)
                        self._live_bytes -= self._sizes.pop(job[0], 0)
                    for fut in (written, job[2] if job else None):
                        if fut is not None and not fut.done():
                            fut.set_exception(failure)
                continue
            for _, written, job in batch:
                if job is not None:
                    seq, change, outcome, early = job
                    self._queue(seq, change, outcome, early)
                if written is not None and not written.done():
                    written.set_result(None)

    def _append(self, data: bytes, sync: bool, compact: dict[int, Change] | None) -> None:
        if compact is not None:
            self._rewrite(compact)
        if self._fd < 0:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        start = self._size   # where this batch begins (O_APPEND; open() and _rewrite set it, appends add)
        try:
            _write_all(self._fd, data)
            if sync:
                os.fdatasync(self._fd)
        except BaseException:   # (a full disk mid-frame): take back what was written, so no torn frame is
            try:                # left for the frames written after it to follow (a start reads up to a tear)
                _truncate(self._fd, start)
            except OSError:
                self._torn = True   # the next write rewrites the log whole first
            raise
        self._size += len(data)

    def _rewrite(self, pending: dict[int, Change]) -> None:
        """Replace the log by one holding only the pending changes (written aside, fsynced, renamed)."""
        tmp = self.path.with_suffix(".tmp")
        data = b"".join(frame(_Frame(seq, c)) for seq, c in sorted(pending.items()))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            _write_all(fd, data)
            os.fsync(fd)
        except BaseException:   # (a full disk): the part written goes, not left to fill it more
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        self._torn = False
        if self._fd >= 0:   # at once: appends go to the new log, never to the old one just unlinked
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self._size = len(data)
        dfd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def _truncate(fd: int, length: int) -> None:
    os.ftruncate(fd, length)


def _write_all(fd: int, data: bytes) -> None:
    """os.write until every byte is written (a short write must not tear a frame)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
