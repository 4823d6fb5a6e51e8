"""The one door to NATS: connection, publishing, inboxes, consumers, provisioning.

KV and object stores are in bus/kvstore.py, stream reads in bus/streamread.py, provisioning in
bus/provision.py (mixins of Bus), the first connect and nats-py's callbacks in bus/connecting.py, and the
mapping of nats errors to ours in bus/nats_errors.py.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
import time
from typing import Awaitable, Callable

import nats
import nats.errors
import nats.js.errors
from nats.js import api

from bus import connecting, lanes, subjects, validate
from bus.acks import AckedPublisher
from bus.creds import credential_options, expired, principal_of
from bus.errors import AuthenticationFailed, BusError, BusUnavailable, InvalidRequest, PermissionDenied
from bus.kvstore import CasResult, KvStore, kv_watch
from bus.messages import ErrorReply, Wire, encode
from bus.nats_errors import check_fits, mapped_errors, not_found, timed_out
from bus.provision import Provisioning
from bus.pull import Handler, PullWorker
from bus.streamread import DurableReader, Pulled, StreamReads

__all__ = ["Bus", "CasResult", "DurableReader", "Pulled", "kv_watch", "mapped_errors", "not_found"]

log = logging.getLogger(__name__)

RETRY_PAUSE = 0.25   # longest pause between two tries of an idempotent publish: a leader back is used at once
# Seconds a JetStream request waits for its answer. A stream or bucket without a leader (an election:
# 4-9 s in nats-server) answers nothing; short tries, retried, use a new leader within a second of its
# election instead of waiting out a long timeout. Provisioning and consumers get the long one.
JS_TIMEOUT = 1.5
ADMIN_TIMEOUT = 10.0
_PUBLISH_DENIED = re.compile(r'Permissions Violation for Publish to "([^"]+)"', re.IGNORECASE)
ADMIN_TRIES = 3   # an idempotent admin request (a consumer's create or delete) unanswered in time is sent again


class Bus(KvStore, StreamReads, Provisioning):
    """A connection to NATS with JetStream, as DSec uses it."""

    def __init__(self, nc, listeners: list | None = None) -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=JS_TIMEOUT)          # the hot path: KV, publishes, message gets
        self.admin = nc.jetstream(timeout=ADMIN_TIMEOUT)    # streams, consumers, object stores
        self._reconnect_listeners = listeners if listeners is not None else []
        self._kv: dict[str, object] = {}
        self._obj: dict[str, object] = {}   # object store handles (kvstore.KvStore._store)
        self._acks = AckedPublisher(nc)
        self.refused: list[str] = []   # the server's refusals of this credential (revoked: reconnects fail)
        self.creds: str | None = None
        # whether it may delete the consumers it made for a read (ops, read-only, may delete none: its
        # ordered consumers go by the server's inactivity timer instead of a refused delete)
        self.deletes_consumers = True
        # set when the client library gave the connection up for good without being asked (nats-py closes,
        # and never reconnects, a connection the server sent a protocol error such as a message over
        # max_payload or an invalid subject); cut_reason says why
        self.cut = asyncio.Event()
        self.cut_reason = ""
        self._closing = False
        # core requests in flight by subject: a publish the server refuses to this credential ends them at
        # once with PermissionDenied (the server says so only asynchronously; they waited out their timeout)
        self._asking: dict[str, set[asyncio.Task]] = {}
        self._refused_tasks: dict[asyncio.Task, str] = {}

    def _violation(self, text: str) -> None:
        """The server refused a publish of this connection (error_cb): end the requests to that subject."""
        m = _PUBLISH_DENIED.search(text)
        if m is None:
            return
        for task in self._asking.get(m.group(1).lower(), ()):   # (nats-py lowercases the server's error)
            if task not in self._refused_tasks and not task.done():
                self._refused_tasks[task] = text
                task.cancel()

    def _closed(self) -> None:
        """nats-py closed the connection: cut, unless close() asked for it."""
        if not self._closing:
            self.cut_reason = str(self.nc.last_error or "closed by the client library")
            log.error("nats: connection %s closed for good: %s", self.nc.options.get("name"), self.cut_reason)
            self.cut.set()

    @classmethod
    async def connect(cls, url: str, name: str = "dsec", *, timeout: float = 3.0,
                      reconnect: bool = True, creds: str | None = None) -> "Bus":
        """Connect (fails with BusUnavailable within `timeout` when nobody answers). creds: a credential
        file (DSec's or nsc's .creds: an nkey seed, or a user JWT with its seed) for a server with auth;
        AuthenticationFailed, naming the file and why, when the server refuses it or it is unreadable."""
        servers = [u.strip() for u in url.split(",") if u.strip()]   # a cluster: "nats://a:4222,nats://b:4223"
        if not servers:   # (nats-py then spun at full CPU for ever, deaf to SIGTERM: an unset $DSEC_NATS, helper C)
            raise InvalidRequest("no NATS server URL given: nats://HOST:PORT (--nats, $DSEC_NATS, or the SDK's url)")
        for server in servers:
            validate.nats_url(server)
        attempt = connecting.Attempt()
        nc = nats.NATS()
        await attempt.connect(nc, servers, url, creds, credential_options(creds), name=name, timeout=timeout,
                              reconnect=reconnect)
        bus = cls(nc, attempt.listeners)
        attempt.bus = bus
        bus.refused, bus.creds, bus.url = attempt.refused, creds, url   # (url, creds: what a helper process connects with)
        bus.deletes_consumers = principal_of(creds) != "ops"
        return bus

    def on_reconnect(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Call fn() after every reconnect (to another server of a cluster, or the same one restarted).
        Returns a function that removes it."""
        self._reconnect_listeners.append(fn)
        return lambda: self._reconnect_listeners.remove(fn) if fn in self._reconnect_listeners else None

    async def close(self) -> None:
        """Flush and close; never raises."""
        self._closing = True
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
                      timeout: float = JS_TIMEOUT, retries: int = 0, retry_for: float = 0.0) -> int:
        """Publish into JetStream and wait for the ack. Returns the stream seq.

        With a msg_id (JetStream dedupes on it) a transport failure is retried `retries` times, or for
        up to `retry_for` seconds (a stream leader moving to another server takes a few seconds), with
        capped, jittered backoff; without one a retry could duplicate, so none is made.
        """
        return (await self._publish(subject, msg, msg_id, timeout, retries, retry_for)).seq

    async def publish_once(self, subject: str, msg: Wire | bytes, *, msg_id: str, timeout: float = JS_TIMEOUT,
                           retries: int = 3, retry_for: float = 10.0) -> tuple[int, bool]:
        """Publish under a msg id; (its stream seq, False) when the stream already had that id (within its
        duplicate window, on any of its subjects: the seq is the first one's), else (seq, True)."""
        ack = await self._publish(subject, msg, msg_id, timeout, retries, retry_for)
        return ack.seq, not ack.duplicate

    async def _publish(self, subject: str, msg: Wire | bytes, msg_id: str | None, timeout: float, retries: int,
                       retry_for: float = 0.0):
        data = msg if isinstance(msg, bytes) else encode(msg)
        headers = {"Nats-Msg-Id": msg_id} if msg_id else None
        check_fits(self.nc, f"publish to {subject}", data, headers)
        give_up = time.monotonic() + retry_for
        attempt = 0
        while True:
            self.check_credential()
            try:
                with mapped_errors(f"publish to {subject}"):
                    return await self.js.publish(subject, data, timeout=timeout, headers=headers)
            except BusError:
                self.check_credential()
                if not msg_id or (attempt >= retries and time.monotonic() >= give_up):
                    raise
            await asyncio.sleep(min(1.0, 0.05 * 2 ** attempt) * (0.5 + random.random()))
            attempt += 1

    async def publish_async(self, subject: str, data: bytes, headers: dict[str, str] | None = None) -> asyncio.Future:
        """Publish into JetStream without waiting for the ack: returns a future of it (see stored()).
        Readers subscribed to the subject get the message at once, as with send(). BusUnavailable while
        the connection is down (nothing is buffered for later: the caller tries again)."""
        if not self.nc.is_connected:
            raise BusUnavailable(f"publish to {subject}: not connected")
        check_fits(self.nc, f"publish to {subject}", data, headers)
        with mapped_errors(f"publish to {subject}"):
            return await self._acks.publish(subject, data, headers)

    @staticmethod
    async def stored(ack: asyncio.Future, timeout: float) -> int:
        """Wait for a publish_async ack; the stream seq, or BusError when none came in time (the
        message may or may not be stored: publish it again under the same msg id)."""
        if ack.cancelled():   # given up on before: not known to be stored
            raise BusError("publish ack: given up on before it came")
        try:
            with mapped_errors("publish ack"):
                return await asyncio.wait_for(asyncio.shield(ack), timeout)
        finally:
            if not ack.done():
                ack.cancel()   # given up on: its late ack, if any, is dropped

    async def send(self, subject: str, msg: Wire | bytes, headers: dict[str, str] | None = None) -> None:
        """Core publish (no ack): replies, heartbeats, anything a reader may miss without harm."""
        data = msg if isinstance(msg, bytes) else encode(msg)
        check_fits(self.nc, f"send to {subject}", data, headers)
        with mapped_errors(f"send to {subject}"):
            await self.nc.publish(subject, data, headers=headers)

    async def reply(self, reply_to: str, msg: Wire) -> bool:
        """Answer a requester on its inbox (only ever a reply subject, subjects.is_reply_subject: a request
        can never make a service publish on a system subject); False when it was not an inbox or the bus
        refused (a reply is a core message: the requester reads the outcome from the records if it misses it)."""
        if not subjects.is_reply_subject(reply_to):
            return False
        try:
            await self.send(reply_to, msg)
            return True
        except BusError as exc:
            log.info("reply to %s lost: %s", reply_to, exc)
            return False
        except InvalidRequest as exc:   # larger than the server takes (a bug of ours: replies are bounded)
            log.error("reply to %s not sent: %s", reply_to, exc)
            with contextlib.suppress(BusError, InvalidRequest):   # the requester hears why, not nothing
                await self.send(reply_to, ErrorReply(request_id=getattr(msg, "request_id", ""), code="internal",
                                                     message=f"the answer was too large to send: {exc}"))
            return False

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

    async def serve(self, subject: str, handle: Callable[[bytes, str], Awaitable[Wire | None]], *, queue: str = ""):
        """Answer core requests on subject: handle(data, subject) runs in a task of its own per request
        (one slow answer holds up no other) and its result, when not None, is the reply. With a queue
        group, one of its members answers each request."""
        tasks: set[asyncio.Task] = set()

        async def _answer(m) -> None:
            try:
                reply = await handle(m.data, m.subject)
            except Exception as exc:     # still one answer: the asker must not wait for nothing
                log.exception("serving %s", m.subject)
                reply = ErrorReply(code="internal", message=f"{exc.__class__.__name__}: {exc}")
            if reply is not None and m.reply:
                try:
                    await self.nc.publish(m.reply, encode(reply))
                except Exception as exc:   # (e.g. larger than the server's max payload): still one answer
                    with contextlib.suppress(Exception):
                        await self.nc.publish(m.reply, encode(ErrorReply(
                            code="internal", message=f"the answer could not be sent: {exc.__class__.__name__}: {exc}")))

        async def _cb(m) -> None:
            task = asyncio.ensure_future(_answer(m))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        with mapped_errors(f"subscribe {subject}"):
            return await self.nc.subscribe(subject, queue=queue, cb=_cb)

    def check_credential(self) -> None:
        """AuthenticationFailed when the server dropped this connection and refuses its credential now
        (revoked while connected): said at once, not as a timeout."""
        if self.refused and not self.nc.is_connected:
            why = expired(self.creds) or "revoked or removed while connected"
            raise AuthenticationFailed(f"NATS refuses the credential {self.creds or '(none)'} now ({why}): "
                                       f"{self.refused[-1]}")

    async def request(self, subject: str, msg: Wire, timeout: float) -> bytes | None:
        """A core request; its reply, or None when nobody serves the subject (now)."""
        self.check_credential()
        data = encode(msg)
        check_fits(self.nc, f"request {subject}", data)
        task = asyncio.current_task()
        asking = self._asking.setdefault(subject.lower(), set())
        asking.add(task)
        try:
            with mapped_errors(f"request {subject}"):
                m = await self.nc.request(subject, data, timeout=timeout)
        except BusError as exc:
            if isinstance(exc.__cause__, nats.errors.NoRespondersError):
                return None
            self.check_credential()
            raise
        except asyncio.CancelledError:
            said = self._refused_tasks.pop(task, None)
            if said is None:
                raise
            if task.uncancel() > 0:   # cancelled for another reason too: that wins
                raise
            raise PermissionDenied(f"request {subject}: the NATS server refused the credential "
                                   f"{self.creds or '(none)'} a publish there") from nats.errors.Error(said)
        finally:
            asking.discard(task)
            if not asking:
                self._asking.pop(subject.lower(), None)
            if self._refused_tasks.pop(task, None) is not None:   # refused just as its reply came: the cancel
                task.uncancel()                                   # was swallowed, and is taken back
        return m.data

    async def flush(self, timeout: float = 2.0) -> None:
        """Round trip to the server: everything sent before is processed."""
        with mapped_errors("flush"):
            await self.nc.flush(timeout=timeout)

    # ---- consumers ----------------------------------------------------------------------------

    async def consumer_pending(self, stream: str, durable: str) -> int:
        """Messages not yet delivered to a consumer."""
        with mapped_errors(f"consumer info {durable}"):
            info = await self.admin.consumer_info(stream, durable)
        return info.num_pending

    async def consumer_delivered(self, stream: str, durable: str) -> int:
        """The stream sequence of the last message a consumer handed out (0: none yet)."""
        with mapped_errors(f"consumer info {durable}"):
            info = await self.js.consumer_info(stream, durable)
        return info.delivered.stream_seq if info.delivered else 0

    async def consumer_ack_pending(self, stream: str, durable: str) -> int:
        """Messages delivered by a consumer and not acked yet (they come again after its ack wait)."""
        with mapped_errors(f"consumer info {durable}"):
            info = await self.admin.consumer_info(stream, durable)
        return info.num_ack_pending

    async def held_on(self, stream: str, subject: str) -> int:
        """How many messages `stream` holds on the subjects matching `subject` (wildcards allowed)."""
        with mapped_errors(f"stream info {stream}"):
            info = await self.admin.stream_info(stream, subjects_filter=subject)
        return sum((info.state.subjects or {}).values())

    async def consumer_config(self, stream: str, durable: str) -> api.ConsumerConfig | None:
        """A durable consumer's configuration, or None when there is none."""
        try:
            with mapped_errors(f"consumer info {durable}"):
                return (await self.admin.consumer_info(stream, durable)).config
        except BusError as exc:
            if not_found(exc):
                return None
            raise

    async def _admin(self, what: str, call: Callable[[], Awaitable[object]]) -> object:
        """An idempotent admin request, sent again while it goes unanswered (a busy meta leader, an
        election): ADMIN_TRIES tries of ADMIN_TIMEOUT each before the BusError."""
        for attempt in range(ADMIN_TRIES):
            try:
                with mapped_errors(what):
                    return await call()
            except BusError as exc:
                if not timed_out(exc) or attempt == ADMIN_TRIES - 1:
                    raise
                log.warning("%s: no answer in %.0fs; asking again", what, ADMIN_TIMEOUT)
        raise AssertionError("unreachable")

    async def delete_consumer(self, stream: str, durable: str) -> None:
        """Delete a durable consumer (absent is fine): its unacked messages go to the next one at once."""
        try:
            await self._admin(f"delete consumer {durable}", lambda: self.admin.delete_consumer(stream, durable))
        except BusError as exc:
            if not isinstance(exc.__cause__, nats.js.errors.NotFoundError):
                raise

    async def ensure_consumer(self, stream: str, config: api.ConsumerConfig) -> None:
        """Create a durable consumer (or keep it as it is)."""
        await self._admin(f"consumer {config.durable_name}", lambda: self.admin.add_consumer(stream, config))

    async def take(self, stream: str, durable: str, handle: Callable[[bytes], Awaitable[bool | None]], *,
                   limit: int = 10_000, wait: float = 0.3) -> int:
        """Pull what waits on an existing durable consumer (a lost node's lanes) and hand each message to
        handle(data): acked when it returns True, left for redelivery when False; None stops the take
        (that message and the rest of its batch are left). Returns how many were taken."""
        try:
            with mapped_errors(f"bind {durable}"):
                sub = await self.admin.pull_subscribe_bind(durable, stream)
        except BusError as exc:
            if not_found(exc):
                return 0
            raise
        taken = 0
        try:
            while taken < limit:
                try:
                    with mapped_errors(f"take from {durable}"):
                        msgs = await sub.fetch(min(100, limit - taken), timeout=wait)
                except BusError as exc:
                    if timed_out(exc):
                        return taken   # nothing more waits
                    raise
                for i, m in enumerate(msgs):
                    ok = await handle(m.data)
                    if ok is None:
                        for left in msgs[i:]:
                            with contextlib.suppress(Exception):
                                await left.nak()
                        return taken
                    with contextlib.suppress(Exception):
                        await (m.ack() if ok else m.nak())
                    taken += ok
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        return taken

    async def pull_worker(self, stream_and_config: tuple[str, api.ConsumerConfig], handler: Handler,
                          credit: Callable[[], int], steps: list | None = None) -> PullWorker:
        """Ensure the durable consumer exists and start a credit-based worker on it; handler runs inside
        `steps` (bus/lanes.py: decode, tenant, lease, retries, counts), the first outermost."""
        stream, config = stream_and_config
        await self.ensure_consumer(stream, config)
        worker = PullWorker(self.nc, stream, config.durable_name, lanes.chain(handler, steps or []), credit)
        await worker.start()
        worker.on_stop = self.on_reconnect(worker.reconnected)
        return worker

    # ---- provisioning -------------------------------------------------------------------------

    async def set_stream_age(self, stream: str, max_age: float) -> None:
        """Set how long a limits stream keeps messages (seconds)."""
        with mapped_errors(f"stream {stream}"):
            cfg = (await self.admin.stream_info(stream)).config
            if cfg.max_age != max_age:
                cfg.max_age = max_age
                await self.admin.update_stream(cfg)

