"""KV buckets and object stores as DSec uses them: compare-and-set writes, listings, watches (a Bus mixin)."""
from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import io
import logging
import random
import time
from dataclasses import dataclass
from typing import Callable

import msgspec
import nats.errors
import nats.js.errors
from nats.js import api

from bus.errors import BusError
from bus.messages import Wire, encode
from bus.nats_errors import check_fits, mapped_errors, not_found, timed_out

log = logging.getLogger(__name__)
SCAN_TRIES = 6   # pulls of a scan's consumer that may meet "no responders" before it is taken up
OBJ_CHUNK = 512 << 10   # an object's bytes per message (under the server's max_payload, 1 MB, with headers)


@dataclass
class CasResult:
    """Outcome of kv_update: the value and revision now stored, conflicts met, whether we wrote."""

    value: bytes | None
    revision: int
    conflicts: int
    written: bool


class KvStore:
    """KV and object-store operations of a Bus (self.js is its JetStream context)."""

    js: object
    admin: object
    _kv: dict
    _obj: dict
    on_reconnect: Callable
    nc: object
    deletes_consumers: bool

    async def kv(self, bucket: str):
        """A KV bucket handle (cached)."""
        if bucket not in self._kv:
            with mapped_errors(f"kv {bucket}"):
                self._kv[bucket] = await self.js.key_value(bucket)
        return self._kv[bucket]

    async def _store(self, bucket: str):
        """An object store handle (cached: nats-py's asks the server for its stream's info each time, a round
        trip per object a layer's lazy chunks paid once each)."""
        if bucket not in self._obj:
            self._obj[bucket] = await self.admin.object_store(bucket)
        return self._obj[bucket]

    async def kv_get(self, bucket: str, key: str) -> bytes | None:
        """Value of key, or None when absent or deleted."""
        kv = await self.kv(bucket)
        try:
            with mapped_errors(f"kv get {bucket}/{key}"):
                entry = await kv.get(key)
        except BusError as exc:
            if isinstance(exc.__cause__, (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError,
                                          nats.js.errors.NotFoundError)):
                return None
            raise
        return entry.value

    async def kv_entry(self, bucket: str, key: str) -> tuple[bytes | None, int]:
        """(value or None, the revision a compare-and-set must name: 0 when the key has no message)."""
        kv = await self.kv(bucket)
        try:
            with mapped_errors(f"kv get {bucket}/{key}"):
                entry = await kv.get(key)
        except BusError as exc:
            cause = exc.__cause__
            if isinstance(cause, (nats.js.errors.KeyNotFoundError, nats.js.errors.NotFoundError)):
                # a deleted key: its tombstone's revision is what a compare-and-set must name
                entry = getattr(cause, "entry", None)
                return None, entry.revision if entry is not None and entry.revision else 0
            raise
        return entry.value, entry.revision

    async def kv_cas(self, bucket: str, key: str, value: bytes, revision: int) -> int | None:
        """Write value only if the key is still at `revision` (0: has no message). New revision, or None
        when someone wrote first."""
        kv = await self.kv(bucket)
        check_fits(self.nc, f"kv update {bucket}/{key}", value, {"Nats-Expected-Last-Subject-Sequence": str(revision)})
        try:
            with mapped_errors(f"kv update {bucket}/{key}"):
                return await kv.update(key, value, last=revision)
        except BusError as exc:
            if isinstance(exc.__cause__, nats.js.errors.KeyWrongLastSequenceError):
                return None
            raise

    async def kv_cas_delete(self, bucket: str, key: str, revision: int) -> bool:
        """Delete key only if it is still at `revision`; False when someone wrote first."""
        kv = await self.kv(bucket)
        try:
            with mapped_errors(f"kv delete {bucket}/{key}"):
                await kv.delete(key, last=revision)
            return True
        except BusError as exc:
            if isinstance(exc.__cause__, (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.BadRequestError)):
                return False
            raise

    async def kv_update(self, bucket: str, key: str, mutate: Callable[[bytes | None], bytes | None], *,
                        known: tuple[bytes | None, int] | None = None, attempts: int = 64) -> CasResult:
        """Read-modify-write with compare-and-set, retried on conflict. mutate(current) returns the new
        value, or None to write nothing; it is called again on the fresh value after every conflict, so
        it must be pure. `known` (value, revision) from a watch saves the first read."""
        current, revision = known if known is not None else await self.kv_entry(bucket, key)
        for conflicts in range(attempts):
            new = mutate(current)
            if new is None:
                return CasResult(current, revision, conflicts, written=False)
            rev = await self.kv_cas(bucket, key, new, revision)
            if rev is not None:
                return CasResult(new, rev, conflicts, written=True)
            current, revision = await self.kv_entry(bucket, key)
        raise BusError(f"kv update {bucket}/{key}: still conflicting after {attempts} attempts")

    async def kv_put(self, bucket: str, key: str, value: Wire | bytes, *, retry_for: float = 0.0) -> int:
        """Put a value; returns its revision. A put is idempotent, so it may be retried for `retry_for` s."""
        kv = await self.kv(bucket)
        data = value if isinstance(value, bytes) else encode(value)
        check_fits(self.nc, f"kv put {bucket}/{key}", data)
        give_up, attempt = time.monotonic() + retry_for, 0
        while True:
            try:
                with mapped_errors(f"kv put {bucket}/{key}"):
                    return await kv.put(key, data)
            except BusError:
                if time.monotonic() >= give_up:
                    raise
            await asyncio.sleep(min(1.0, 0.05 * 2 ** attempt) * (0.5 + random.random()))
            attempt += 1

    async def kv_delete(self, bucket: str, key: str) -> None:
        """Delete a key (absent is fine)."""
        kv = await self.kv(bucket)
        with mapped_errors(f"kv delete {bucket}/{key}"), contextlib.suppress(nats.js.errors.KeyNotFoundError):
            await kv.delete(key)

    async def kv_remove(self, bucket: str, key: str) -> None:
        """Delete a key leaving no delete marker, in a bucket nothing watches (its readers find the key absent
        either way, and a marker per key ever deleted would stay for good). A value written after the one
        read here stays."""
        _, revision = await self.kv_entry(bucket, key)
        if revision:
            with mapped_errors(f"kv remove {bucket}/{key}"):
                await self.js.purge_stream(f"KV_{bucket}", subject=f"$KV.{bucket}.{key}", seq=revision + 1)

    async def kv_purge_deletes(self, bucket: str, older_than: float, at_most: int = 1000) -> int:
        """Drop up to at_most of a bucket's delete markers older than older_than seconds (a bucket otherwise
        keeps one for every key ever deleted, and each whole-bucket read goes through them all); how many.
        nats-py's purge_deletes left its watcher running, and purged every marker in one go. A watcher that
        missed a delete learns it from kv_watch's on_synced."""
        kv = await self.kv(bucket)
        stream = f"KV_{bucket}"
        cutoff = time.time() - older_than
        old: list[tuple[str, int]] = []
        with mapped_errors(f"kv purge deletes {bucket}"):
            watcher = await kv.watchall()
            try:
                while True:
                    entry = await watcher.updates(timeout=5.0)
                    if entry is None or not hasattr(entry, "key"):
                        break
                    if entry.operation in ("DEL", "PURGE") and entry.created is not None \
                            and entry.created.timestamp() < cutoff:
                        old.append((entry.key, entry.revision))
            finally:
                with contextlib.suppress(Exception):
                    await watcher.stop()
            for key, revision in old[:at_most]:   # (up to the marker only: a value written since stays)
                await self.js.purge_stream(stream, subject=f"$KV.{bucket}.{key}", seq=revision + 1)
        return min(len(old), at_most)

    async def kv_items(self, bucket: str, tries: int = 5, *, prefix: str = "",
                       keys: str = "") -> list[tuple[str, bytes]]:
        """Every live (key, value) of a bucket (with `prefix`: only the keys `<prefix>.*`, read by subject,
        at the cost of those alone), read through one ordered pass over its stream. The pass runs on
        whichever replica the server picks for it; one still catching up (a server just back) would list an
        old state, so a whole-bucket pass that ends short of the last sequence the stream's leader reported
        before it started is done again (BusError after `tries`). `keys`: only the keys a filter with
        wildcards matches (`acme.*.sb-1`), read the same way as a prefix."""
        if prefix or keys:
            return await self._kv_filtered(bucket, keys or f"{prefix}.>")
        for attempt in range(tries):
            out: dict[str, bytes] = {}
            prefix = f"$KV.{bucket}."
            with mapped_errors(f"kv list {bucket}"):
                info = await self.js.stream_info(f"KV_{bucket}")
            if info.state.messages == 0:
                return []
            upto = 0
            async for subject, data, op, seq in self._kv_stream(bucket):
                upto = max(upto, seq)
                key = subject[len(prefix):]
                if op in ("DEL", "PURGE"):
                    out.pop(key, None)
                else:
                    out[key] = data
            if upto >= info.state.last_seq or await self.stored_after(f"KV_{bucket}", f"$KV.{bucket}.>", upto) is None:
                return list(out.items())   # (a tail purged since, or expired: nothing stored after what was read)
            log.info("kv list %s read a replica behind its leader (%d < %d): again", bucket, upto,
                     info.state.last_seq)
            await asyncio.sleep(0.2 * (attempt + 1))
        raise BusError(f"kv list {bucket}: every pass read a replica behind the stream's leader")

    async def kv_values(self, bucket: str, decoder, *, prefix: str = "", keys: str = "") -> list:
        """Every live value of a bucket (or of its keys `<prefix>.*`, or those `keys` matches) decoded; junk
        is skipped, never fatal."""
        out = []
        for _, raw in await self.kv_items(bucket, prefix=prefix, keys=keys):
            try:
                out.append(decoder.decode(raw))
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
        return out

    async def _kv_filtered(self, bucket: str, keys: str) -> list[tuple[str, bytes]]:
        subject = f"$KV.{bucket}.{keys}"
        if not await self._has_messages(f"KV_{bucket}", subject):
            return []
        out: dict[str, bytes] = {}
        head = f"$KV.{bucket}."
        async for subj, data, op, _seq in self._kv_stream(bucket, subject):
            if op in ("DEL", "PURGE"):
                out.pop(subj[len(head):], None)
            else:
                out[subj[len(head):]] = data
        return list(out.items())

    async def kv_scan(self, bucket: str, keys: str, after: int = 0, want: Callable[[], int] = lambda: 256):
        """The entries of the keys a filter matches (`acme.>`) stored after stream sequence `after`, in
        sequence order: (key, value or None for a delete, its sequence, how many matching entries follow).
        A bucket keeping one revision per key (history=1) holds each key's latest alone, so a reader may
        stop anywhere and go on after the last sequence it took, reading each entry once (one written
        meanwhile comes again, later). Pulled want() at a time, which the reader says as it goes (a page of
        500 needs at most 500 more): a reader that stops received little it did not take. Iterate it under
        contextlib.aclosing when stopping early."""
        subject, stream = f"$KV.{bucket}.{keys}", f"KV_{bucket}"
        first = await self.stored_after(stream, subject, after)
        if first is None:
            return
        config = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=first.seq,
                                    ack_policy=api.AckPolicy.NONE, inactive_threshold=10.0, mem_storage=True,
                                    num_replicas=1)
        head = f"$KV.{bucket}."
        with mapped_errors(f"kv scan {bucket}"):
            sub = await self.js.pull_subscribe(subject, stream=stream, config=config)
        try:
            while True:
                for attempt in range(SCAN_TRIES):
                    try:
                        with mapped_errors(f"kv scan {bucket}"):
                            msgs = await sub.fetch(max(1, min(want(), 1000)), timeout=3)
                        break
                    except BusError as exc:
                        if timed_out(exc):
                            raise BusError(f"kv scan {bucket}: the read stalled before its end") from exc
                        # a consumer just made on a replicated stream may answer "no responders" (503) to its
                        # first pulls, before its server has taken it up (helper 28: 3 of 300 fetches)
                        if attempt == SCAN_TRIES - 1 or not isinstance(
                                exc.__cause__, (nats.js.errors.ServiceUnavailableError, nats.errors.NoRespondersError)):
                            raise
                        await asyncio.sleep(0.05 * (attempt + 1))
                for m in msgs:
                    op = (m.headers or {}).get("KV-Operation", "PUT")
                    pending = m.metadata.num_pending
                    yield m.subject[len(head):], None if op in ("DEL", "PURGE") else m.data, \
                        m.metadata.sequence.stream, pending
                    if pending == 0:
                        return
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            if self.deletes_consumers:   # (now, not at its inactive threshold: see _kv_stream)
                with contextlib.suppress(Exception):
                    await self.nc.publish(f"$JS.API.CONSUMER.DELETE.{stream}.{sub._consumer}", b"")

    async def kv_last_seq(self, bucket: str) -> int:
        """The last stream sequence a bucket stored (as its stream's leader says)."""
        with mapped_errors(f"kv info {bucket}"):
            return (await self.js.stream_info(f"KV_{bucket}")).state.last_seq

    async def kv_max_age(self, bucket: str) -> float:
        """How long a bucket keeps a key not written again (seconds; 0: for ever)."""
        with mapped_errors(f"kv info {bucket}"):
            return (await self.js.stream_info(f"KV_{bucket}")).config.max_age or 0.0

    async def _kv_stream(self, bucket: str, subject: str = ""):
        with mapped_errors(f"kv list {bucket}"):
            sub = await self.js.subscribe(subject or f"$KV.{bucket}.>", stream=f"KV_{bucket}", ordered_consumer=True,
                                          deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT)
        try:
            while True:
                try:
                    with mapped_errors(f"kv list {bucket}"):
                        m = await sub.next_msg(timeout=3)
                except BusError as exc:
                    if not isinstance(exc.__cause__, (nats.errors.TimeoutError, asyncio.TimeoutError)):
                        raise
                    # silence before the last entry: a stall, not the end (unless the bucket emptied)
                    with mapped_errors(f"kv list {bucket}"):
                        if (await self.js.stream_info(f"KV_{bucket}")).state.messages == 0:
                            return
                    raise BusError(f"kv list {bucket}: the listing stalled before its end") from exc
                yield m.subject, m.data, (m.headers or {}).get("KV-Operation", "PUT"), m.metadata.sequence.stream
                if m.metadata.num_pending == 0:
                    return
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
                # and the consumer deleted now, without waiting for the answer: left to the server's
                # inactivity timer (5 s), a pass per request at a few hundred a second reaches the server's
                # limit of consumers on the stream (1,000 here), and every later list fails. Not by a
                # principal that may delete none (ops): its rare lists leave that to the timer
                if self.deletes_consumers:
                    await self.nc.publish(f"$JS.API.CONSUMER.DELETE.KV_{bucket}.{sub._consumer}", b"")

    async def obj_put(self, bucket: str, name: str, data: bytes) -> None:
        """Store an object."""
        with mapped_errors(f"object put {bucket}/{name}"):
            store = await self._store(bucket)
            await store.put(name, data, meta=_chunked(name, self.nc))

    async def obj_put_file(self, bucket: str, name: str, path) -> None:
        """Store a file as an object, read a chunk at a time (a layer is never held whole in memory)."""
        with mapped_errors(f"object put {bucket}/{name}"), open(path, "rb") as f:
            store = await self._store(bucket)
            await store.put(name, f, meta=_chunked(name, self.nc))

    async def obj_get_file(self, bucket: str, name: str, path) -> None:
        """Fetch an object into a file, a chunk at a time (digest verified by the client)."""
        with mapped_errors(f"object get {bucket}/{name}"), open(path, "wb") as f:
            store = await self._store(bucket)
            await store.get(name, writeinto=f)

    async def obj_has(self, bucket: str, name: str) -> bool:
        """Whether an object is stored."""
        try:
            with mapped_errors(f"object info {bucket}/{name}"):
                store = await self._store(bucket)
                await store.get_info(name)
        except BusError as exc:
            if not_found(exc):
                return False
            raise
        return True

    async def obj_delete(self, bucket: str, name: str) -> None:
        """Delete an object (absent: nothing to do): its chunks, and then the deleted-marker its store leaves
        (one per object ever deleted otherwise stays for good). An object stored again since keeps its own."""
        try:
            with mapped_errors(f"object delete {bucket}/{name}"):
                store = await self._store(bucket)
                await store.delete(name)
        except BusError as exc:
            if not not_found(exc):
                raise
        meta = f"$O.{bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"
        try:
            with mapped_errors(f"object delete {bucket}/{name}"):
                last = await self.js.get_last_msg(f"OBJ_{bucket}", meta)
                if msgspec.json.decode(last.data or b"{}").get("deleted"):
                    await self.js.purge_stream(f"OBJ_{bucket}", subject=meta, seq=last.seq + 1)
        except BusError as exc:
            if not not_found(exc):
                raise
        except (msgspec.DecodeError, AttributeError):
            pass   # not a store's meta: left as it is

    async def obj_list(self, bucket: str) -> dict[str, float]:
        """Every object stored: its name -> when it was stored (epoch seconds; 0 when not said)."""
        try:
            with mapped_errors(f"object list {bucket}"):
                store = await self._store(bucket)
                infos = await store.list(ignore_deletes=True)
        except BusError as exc:
            if not_found(exc):
                return {}
            raise
        out = {}
        for info in infos:
            try:
                out[info.name] = datetime.datetime.fromisoformat(info.mtime).timestamp() if info.mtime else 0.0
            except (TypeError, ValueError):
                out[info.name] = 0.0
        return out

    async def obj_get(self, bucket: str, name: str) -> bytes:
        """Fetch an object (digest verified by the client); BusError if missing or corrupt."""
        buf = io.BytesIO()   # nats-py appends chunks to one bytes object otherwise: quadratic (100 MiB took 27 s)
        with mapped_errors(f"object get {bucket}/{name}"):
            store = await self._store(bucket)
            await store.get(name, writeinto=buf)
        return buf.getvalue()


def _chunked(name: str, nc) -> api.ObjectMeta:
    """An object's meta: its bytes in messages of OBJ_CHUNK, or less on a server that takes less (nats-py's
    default, 128 KiB, took one publish and its ack per 128 KiB: 8,192 round trips a GiB)."""
    room = getattr(nc, "max_payload", 0) - (16 << 10)   # (its subject and headers)
    size = min(OBJ_CHUNK, room) if room >= 128 << 10 else 128 << 10
    return api.ObjectMeta(name=name, options=api.ObjectMetaOptions(max_chunk_size=size))


async def kv_watch(bus, bucket: str, on_change: Callable[[str, bytes | None, int], None], *,
                   resync_every: float = 15.0, on_synced: Callable[[set[str]], None] | None = None,
                   on_start: Callable[[], None] | None = None, restart: asyncio.Event | None = None) -> "asyncio.Task":
    """Call on_change(key, value or None on delete, revision) for every current and future entry of a bucket.

    The watch is an ephemeral consumer on one server; if that server dies the watch can go silent. So
    it is started afresh after a reconnect, and whenever nothing arrived for `resync_every` seconds
    (the current values are delivered again: callbacks must be idempotent per revision). After each
    delivery of the current values, on_synced(the keys that have one): a key deleted while the watch was
    away, whose delete marker was swept since (kv_purge_deletes), is in no update, only missing there.
    on_start() is called as each watch begins; setting `restart` starts it afresh (a reader that finds it
    behind)."""
    kv = await bus.kv(bucket)
    restart = restart if restart is not None else asyncio.Event()
    remove = bus.on_reconnect(restart.set)

    async def _one() -> None:
        if on_start is not None:
            on_start()
        watcher = await kv.watchall()
        present: set[str] | None = set()
        try:
            while True:
                try:
                    entry = await watcher.updates(timeout=resync_every)
                except nats.errors.TimeoutError:
                    return
                if entry is None:   # end of the initial values
                    if present is not None and on_synced is not None:
                        on_synced(present)
                    present = None
                    continue
                if not hasattr(entry, "key"):
                    return     # the watcher was stopped
                deleted = entry.operation in ("DEL", "PURGE")
                if present is not None and not deleted:
                    present.add(entry.key)
                on_change(entry.key, None if deleted else entry.value, entry.revision)
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()

    async def _run() -> None:
        try:
            while True:
                restart.clear()
                watch = asyncio.create_task(_one())
                signal = asyncio.create_task(restart.wait())
                try:
                    await asyncio.wait({watch, signal}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for t in (watch, signal):
                        t.cancel()
                    results = await asyncio.gather(watch, signal, return_exceptions=True)
                exc = results[0]
                if isinstance(exc, Exception) and not isinstance(exc, asyncio.CancelledError):
                    log.debug("kv watch %s: %s", bucket, exc)   # reconnects, server restarts: watch again
                    await asyncio.sleep(0.5)
        finally:
            remove()

    return asyncio.create_task(_run())
