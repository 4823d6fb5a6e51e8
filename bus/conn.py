"""The one door to NATS: connection, publishing, inboxes, KV, object store, provisioning, error mapping."""
from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import random
import time
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

import nats
import nats.errors
import nats.js.errors
from nats.js import api

from bus import streams
from bus.errors import BusError, BusUnavailable
from bus.messages import ErrorReply, Wire, encode
from bus.pull import Handler, PullWorker

log = logging.getLogger(__name__)


@contextlib.contextmanager
def mapped_errors(what: str):
    """Translate nats errors raised inside the block into BusError / BusUnavailable, once."""
    try:
        yield
    except (nats.errors.TimeoutError, asyncio.TimeoutError, nats.errors.NoRespondersError) as exc:
        raise BusError(f"{what}: NATS did not answer in time") from exc   # (TimeoutError is an OSError too)
    except (nats.errors.NoServersError, nats.errors.ConnectionClosedError, OSError) as exc:
        raise BusUnavailable(f"{what}: NATS unavailable ({exc.__class__.__name__})") from exc
    except nats.errors.Error as exc:
        raise BusError(f"{what}: {exc}") from exc


def _not_found(exc: BusError) -> bool:
    """Whether a mapped error says the message or object asked for is not there (not a failure)."""
    return isinstance(exc.__cause__, nats.js.errors.NotFoundError)   # ObjectNotFoundError is one too


@dataclass
class Pulled:
    """One message of a DurableReader: its data, stream sequence and time, and its ack."""

    data: bytes
    seq: int
    at: float
    _msg: object
    pending: int = 0     # messages of the consumer still after this one when it was delivered

    async def ack(self) -> None:
        """Done with it: a durable consumer will not hand it out again."""
        with mapped_errors("ack"):
            await self._msg.ack()


class DurableReader:
    """Batches from a pull consumer (see Bus.durable_reader)."""

    def __init__(self, sub) -> None:
        self._sub = sub

    async def fetch(self, n: int, timeout: float) -> list[Pulled]:
        """Up to n messages; [] when none arrived within timeout."""
        try:
            with mapped_errors("fetch"):
                msgs = await self._sub.fetch(n, timeout=timeout)
        except BusError as exc:
            if isinstance(exc.__cause__, (nats.errors.TimeoutError, asyncio.TimeoutError)):
                return []
            raise
        out = []
        for m in msgs:
            meta = m.metadata
            out.append(Pulled(m.data, meta.sequence.stream, meta.timestamp.timestamp() if meta.timestamp else 0.0, m,
                              meta.num_pending or 0))
        return out

    async def close(self) -> None:
        """Stop reading (a durable consumer stays on the server, with its position)."""
        with contextlib.suppress(Exception):
            await self._sub.unsubscribe()


@dataclass
class CasResult:
    """Outcome of kv_update: the value and revision now stored, conflicts met, whether we wrote."""

    value: bytes | None
    revision: int
    conflicts: int
    written: bool


class Bus:
    """A connection to NATS with JetStream, as DSec uses it."""

    def __init__(self, nc, listeners: list | None = None) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self._reconnect_listeners = listeners if listeners is not None else []
        self._kv: dict[str, object] = {}
        self._obj: dict[str, object] = {}

    @classmethod
    async def connect(cls, url: str, name: str = "dsec", *, timeout: float = 3.0,
                      reconnect: bool = True) -> "Bus":
        """Connect (fails with BusUnavailable within `timeout` when nobody answers)."""
        async def _quiet(exc: Exception) -> None:
            log.debug("nats: %s", exc)

        listeners: list[Callable[[], None]] = []

        async def _reconnected() -> None:   # pull requests and push consumers died with the old server
            log.info("nats: reconnected")
            for fn in list(listeners):
                fn()

        servers = [u.strip() for u in url.split(",") if u.strip()]   # a cluster: "nats://a:4222,nats://b:4223"
        try:
            nc = await asyncio.wait_for(
                nats.connect(servers, name=name, connect_timeout=timeout, max_reconnect_attempts=-1 if reconnect else 0,
                             allow_reconnect=reconnect, reconnect_time_wait=0.5, error_cb=_quiet,
                             reconnected_cb=_reconnected,
                             pending_size=64 << 20),
                timeout=timeout + 1)
        except (asyncio.TimeoutError, OSError, nats.errors.Error) as exc:
            raise BusUnavailable(f"cannot connect to NATS at {url}") from exc
        return cls(nc, listeners)

    def on_reconnect(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Call fn() after every reconnect (to another server of a cluster, or the same one restarted).
        Returns a function that removes it."""
        self._reconnect_listeners.append(fn)
        return lambda: self._reconnect_listeners.remove(fn) if fn in self._reconnect_listeners else None

    async def close(self) -> None:
        """Flush and close; never raises."""
        try:
            await asyncio.wait_for(self.nc.drain(), timeout=1)
        except Exception:
            with contextlib.suppress(Exception):
                await self.nc.close()

    @property
    def connected(self) -> bool:
        """Whether the connection is up now."""
        return self.nc.is_connected

    def inbox(self) -> str:
        """A fresh unique core subject for replies."""
        return self.nc.new_inbox()

    # ---- publishing ---------------------------------------------------------------------------

    async def publish(self, subject: str, msg: Wire | bytes, *, msg_id: str | None = None,
                      timeout: float = 5.0, retries: int = 0, retry_for: float = 0.0) -> int:
        """Publish into JetStream and wait for the ack. Returns the stream seq.

        With a msg_id (JetStream dedupes on it) a transport failure is retried `retries` times, or for
        up to `retry_for` seconds (a stream leader moving to another server takes a few seconds), with
        capped, jittered backoff; without one a retry could duplicate, so none is made.
        """
        return (await self._publish(subject, msg, msg_id, timeout, retries, retry_for)).seq

    async def publish_once(self, subject: str, msg: Wire | bytes, *, msg_id: str, timeout: float = 5.0,
                           retries: int = 3, retry_for: float = 10.0) -> bool:
        """Publish under a msg id; False when the stream already had that id (within its duplicate window,
        on any of its subjects): someone published this message before, and it was not stored again."""
        return not (await self._publish(subject, msg, msg_id, timeout, retries, retry_for)).duplicate

    async def _publish(self, subject: str, msg: Wire | bytes, msg_id: str | None, timeout: float, retries: int,
                       retry_for: float = 0.0):
        data = msg if isinstance(msg, bytes) else encode(msg)
        headers = {"Nats-Msg-Id": msg_id} if msg_id else None
        give_up = time.monotonic() + retry_for
        attempt = 0
        while True:
            try:
                with mapped_errors(f"publish to {subject}"):
                    return await self.js.publish(subject, data, timeout=timeout, headers=headers)
            except BusError:
                if not msg_id or (attempt >= retries and time.monotonic() >= give_up):
                    raise
            await asyncio.sleep(min(1.0, 0.05 * 2 ** attempt) * (0.5 + random.random()))
            attempt += 1

    async def send(self, subject: str, msg: Wire | bytes, headers: dict[str, str] | None = None) -> None:
        """Core publish (no ack): replies, and output chunks followed by an acked record."""
        data = msg if isinstance(msg, bytes) else encode(msg)
        with mapped_errors(f"send to {subject}"):
            await self.nc.publish(subject, data, headers=headers)

    async def subscribe(self, subject: str, cb: Callable[..., Awaitable[None]], *, with_headers: bool = False):
        """Core subscription; cb(data, subject), or cb(data, subject, headers) with_headers. Returns an
        object with async unsubscribe()."""
        async def _cb(m) -> None:
            if with_headers:
                await cb(m.data, m.subject, m.headers)
            else:
                await cb(m.data, m.subject)

        with mapped_errors(f"subscribe {subject}"):
            return await self.nc.subscribe(subject, cb=_cb, pending_msgs_limit=1_000_000,
                                           pending_bytes_limit=256 << 20)

    async def serve(self, subject: str, handle: Callable[[bytes, str], Awaitable[Wire | None]]):
        """Answer core requests on subject: handle(data, subject) runs in a task of its own per request
        (one slow answer holds up no other) and its result, when not None, is the reply."""
        tasks: set[asyncio.Task] = set()

        async def _answer(m) -> None:
            try:
                reply = await handle(m.data, m.subject)
            except Exception as exc:     # still one answer: the asker must not wait for nothing
                log.exception("serving %s", m.subject)
                reply = ErrorReply(code="internal", message=f"{exc.__class__.__name__}: {exc}")
            if reply is not None and m.reply:
                with contextlib.suppress(Exception):
                    await self.nc.publish(m.reply, encode(reply))

        async def _cb(m) -> None:
            task = asyncio.ensure_future(_answer(m))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        with mapped_errors(f"subscribe {subject}"):
            return await self.nc.subscribe(subject, cb=_cb)

    async def request(self, subject: str, msg: Wire, timeout: float) -> bytes | None:
        """A core request; its reply, or None when nobody serves the subject (now)."""
        try:
            with mapped_errors(f"request {subject}"):
                m = await self.nc.request(subject, encode(msg), timeout=timeout)
        except BusError as exc:
            if isinstance(exc.__cause__, nats.errors.NoRespondersError):
                return None
            raise
        return m.data

    async def flush(self, timeout: float = 2.0) -> None:
        """Round trip to the server: everything sent before is processed."""
        with mapped_errors("flush"):
            await self.nc.flush(timeout=timeout)

    # ---- streams ------------------------------------------------------------------------------

    async def read_subject(self, stream: str, subject: str, *, timeout: float = 5.0,
                           with_headers: bool = False) -> AsyncIterator:
        """Every message stored on `subject` (wildcards allowed), oldest first, until caught up: its
        data, or (data, headers) with_headers."""
        with mapped_errors(f"read {subject}"):
            sub = await self.js.subscribe(subject, stream=stream, ordered_consumer=True)
        try:
            while True:
                try:
                    m = await sub.next_msg(timeout=timeout)
                except nats.errors.TimeoutError:
                    return
                yield (m.data, m.headers) if with_headers else m.data
                if m.metadata.num_pending == 0:
                    return
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def last_on_subject(self, stream: str, subject: str, *, with_headers: bool = False):
        """The last message stored on a subject (its data, or (data, headers) with_headers), or None."""
        try:
            with mapped_errors(f"last of {subject}"):
                m = await self.js.get_last_msg(stream, subject)
        except BusError as exc:
            if _not_found(exc):
                return None
            raise
        return (m.data, m.headers) if with_headers else m.data

    async def consumer_pending(self, stream: str, durable: str) -> int:
        """Messages not yet delivered to a consumer."""
        with mapped_errors(f"consumer info {durable}"):
            info = await self.js.consumer_info(stream, durable)
        return info.num_pending

    async def consumer_ack_pending(self, stream: str, durable: str) -> int:
        """Messages delivered by a consumer and not acked yet (they come again after its ack wait)."""
        with mapped_errors(f"consumer info {durable}"):
            info = await self.js.consumer_info(stream, durable)
        return info.num_ack_pending

    async def delete_consumer(self, stream: str, durable: str) -> None:
        """Delete a durable consumer (absent is fine): its unacked messages go to the next one at once."""
        try:
            with mapped_errors(f"delete consumer {durable}"):
                await self.js.delete_consumer(stream, durable)
        except BusError as exc:
            if not isinstance(exc.__cause__, nats.js.errors.NotFoundError):
                raise

    async def ensure_consumer(self, stream: str, config: api.ConsumerConfig) -> None:
        """Create a durable consumer (or keep it as it is)."""
        with mapped_errors(f"consumer {config.durable_name}"):
            await self.js.add_consumer(stream, config)

    async def take(self, stream: str, durable: str, handle: Callable[[bytes], Awaitable[bool]], *,
                   limit: int = 10_000, wait: float = 0.3) -> int:
        """Pull what waits on an existing durable consumer (a lost node's lanes) and hand each message to
        handle(data): acked when it returns True, else left for redelivery. Returns how many were taken."""
        try:
            with mapped_errors(f"bind {durable}"):
                sub = await self.js.pull_subscribe_bind(durable, stream)
        except BusError as exc:
            if isinstance(exc.__cause__, nats.js.errors.NotFoundError):
                return 0
            raise
        taken = 0
        try:
            while taken < limit:
                try:
                    with mapped_errors(f"take from {durable}"):
                        msgs = await sub.fetch(min(100, limit - taken), timeout=wait)
                except BusError as exc:
                    if isinstance(exc.__cause__, (nats.errors.TimeoutError, asyncio.TimeoutError)):
                        return taken   # nothing more waits
                    raise
                for m in msgs:
                    ok = await handle(m.data)
                    with contextlib.suppress(Exception):
                        await (m.ack() if ok else m.nak())
                    taken += ok
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        return taken

    async def durable_reader(self, stream: str, config: api.ConsumerConfig) -> "DurableReader":
        """A pull consumer read in batches by its holder (who acks): trajectory consumers. A durable
        one resumes where it was left, after any restart."""
        with mapped_errors(f"consumer {config.durable_name or 'ephemeral'}"):
            if config.durable_name:
                await self.js.add_consumer(stream, config)
                sub = await self.js.pull_subscribe_bind(config.durable_name, stream)
            else:
                sub = await self.js.pull_subscribe(config.filter_subject, stream=stream, config=config)
        return DurableReader(sub)

    async def pull_worker(self, stream_and_config: tuple[str, api.ConsumerConfig], handler: Handler,
                          credit: Callable[[], int]) -> PullWorker:
        """Ensure the durable consumer exists and start a credit-based worker on it."""
        stream, config = stream_and_config
        with mapped_errors(f"consumer {config.durable_name}"):
            await self.js.add_consumer(stream, config)
        worker = PullWorker(self.nc, stream, config.durable_name, handler, credit)
        await worker.start()
        worker.on_stop = self.on_reconnect(worker.reconnected)
        return worker

    # ---- KV and object store ------------------------------------------------------------------

    async def kv(self, bucket: str):
        """A KV bucket handle (cached)."""
        if bucket not in self._kv:
            with mapped_errors(f"kv {bucket}"):
                self._kv[bucket] = await self.js.key_value(bucket)
        return self._kv[bucket]

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

    async def kv_items(self, bucket: str) -> list[tuple[str, bytes]]:
        """Every live (key, value) of a bucket, read through one ordered pass over its stream."""
        out: dict[str, bytes] = {}
        prefix = f"$KV.{bucket}."
        async for subject, data, op in self._kv_stream(bucket):
            key = subject[len(prefix):]
            if op in ("DEL", "PURGE"):
                out.pop(key, None)
            else:
                out[key] = data
        return list(out.items())

    async def _kv_stream(self, bucket: str):
        with mapped_errors(f"kv list {bucket}"):
            info = await self.js.stream_info(f"KV_{bucket}")
            if info.state.messages == 0:
                return
            sub = await self.js.subscribe(f"$KV.{bucket}.>", stream=f"KV_{bucket}", ordered_consumer=True,
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
                yield m.subject, m.data, (m.headers or {}).get("KV-Operation", "PUT")
                if m.metadata.num_pending == 0:
                    return
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def obj_put(self, bucket: str, name: str, data: bytes) -> None:
        """Store an object."""
        with mapped_errors(f"object put {bucket}/{name}"):
            store = await self.js.object_store(bucket)
            await store.put(name, data)

    async def obj_has(self, bucket: str, name: str) -> bool:
        """Whether an object is stored."""
        try:
            with mapped_errors(f"object info {bucket}/{name}"):
                store = await self.js.object_store(bucket)
                await store.get_info(name)
        except BusError as exc:
            if _not_found(exc):
                return False
            raise
        return True

    async def obj_delete(self, bucket: str, name: str) -> None:
        """Delete an object (absent: nothing to do)."""
        try:
            with mapped_errors(f"object delete {bucket}/{name}"):
                store = await self.js.object_store(bucket)
                await store.delete(name)
        except BusError as exc:
            if not _not_found(exc):
                raise

    async def obj_get(self, bucket: str, name: str) -> bytes:
        """Fetch an object (digest verified by the client); BusError if missing or corrupt."""
        buf = io.BytesIO()   # nats-py appends chunks to one bytes object otherwise: quadratic (100 MiB took 27 s)
        with mapped_errors(f"object get {bucket}/{name}"):
            store = await self.js.object_store(bucket)
            await store.get(name, writeinto=buf)
        return buf.getvalue()

    # ---- provisioning -------------------------------------------------------------------------

    async def set_stream_age(self, stream: str, max_age: float) -> None:
        """Set how long a limits stream keeps messages (seconds)."""
        with mapped_errors(f"stream {stream}"):
            cfg = (await self.js.stream_info(stream)).config
            if cfg.max_age != max_age:
                cfg.max_age = max_age
                await self.js.update_stream(cfg)

    async def provision(self, retention: streams.Retention | None = None, replicas: int = 1) -> None:
        """Create or update every stream, KV bucket and object store; safe to run any number of times.
        Existing streams keep their ages and sizes unless a retention is given (`dsec up` gives one; an
        edge or engine joining provisions without, so it never undoes the operator's choice)."""
        ret = retention or streams.Retention()
        for stream, durable in streams.LEGACY_CONSUMERS:
            try:
                await self.delete_consumer(stream, durable)
            except BusError:
                pass   # no such stream yet
        for cfg in streams.stream_configs(ret, replicas):
            with mapped_errors(f"stream {cfg.name}"):
                try:
                    await self.js.add_stream(cfg)
                except nats.js.errors.BadRequestError:
                    # exists: bring limits up to date, but never scale a replicated stream down (an edge
                    # joining a cluster provisions too)
                    have = await self.js.stream_info(cfg.name)
                    cfg.num_replicas = max(cfg.num_replicas or 1, have.config.num_replicas or 1)
                    if retention is None:
                        cfg.max_age, cfg.max_bytes = have.config.max_age, have.config.max_bytes
                    await self.js.update_stream(cfg)
        for kcfg in streams.kv_configs(ret, replicas):
            with mapped_errors(f"kv {kcfg.bucket}"):
                try:
                    await self.js.create_key_value(kcfg)
                except nats.js.errors.BadRequestError:   # exists: keep it, but bring its TTL up to date
                    have = (await self.js.stream_info(f"KV_{kcfg.bucket}")).config
                    if (have.max_age or 0) != (kcfg.ttl or 0):
                        have.max_age = kcfg.ttl
                        await self.js.update_stream(have)
        for ocfg in streams.object_configs(replicas):
            with mapped_errors(f"object store {ocfg.bucket}"):
                try:
                    await self.js.create_object_store(ocfg.bucket, config=ocfg)
                except nats.js.errors.BadRequestError:
                    await self.js.object_store(ocfg.bucket)


async def kv_watch(bus: Bus, bucket: str, on_change: Callable[[str, bytes | None, int], None], *,
                   resync_every: float = 15.0) -> "asyncio.Task":
    """Call on_change(key, value or None on delete, revision) for every current and future entry of a bucket.

    The watch is an ephemeral consumer on one server; if that server dies the watch can go silent. So
    it is started afresh after a reconnect, and whenever nothing arrived for `resync_every` seconds
    (the current values are delivered again: callbacks must be idempotent per revision)."""
    kv = await bus.kv(bucket)
    restart = asyncio.Event()
    remove = bus.on_reconnect(restart.set)

    async def _one() -> None:
        watcher = await kv.watchall()
        try:
            while True:
                try:
                    entry = await watcher.updates(timeout=resync_every)
                except nats.errors.TimeoutError:
                    return
                if entry is None:
                    continue   # end of the initial values
                if not hasattr(entry, "key"):
                    return     # the watcher was stopped
                deleted = entry.operation in ("DEL", "PURGE")
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
