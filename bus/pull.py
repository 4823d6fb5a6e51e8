"""Credit-based pull consumer: messages arrive as soon as they exist, never more than the holder has room for.

nats-py's fetch(batch>1) lingers until the batch fills or the timeout passes, which adds latency.
Here each pull request asks for exactly the credit the holder has (free sandbox slots, free exec
slots); the server delivers each message the moment it exists. Unplaced work stays in JetStream.
Ack happens in exactly one place: `_settle`, after the handler returns.
"""
from __future__ import annotations

import asyncio
import collections
import enum
import json
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from nats.aio.msg import Msg

log = logging.getLogger(__name__)

# Seconds a pull request lingers on the server. Short: when a consumer's leader dies, the requests it held
# die with it, unanswered, and the worker asks again only once it counts them expired.
PULL_EXPIRES = 1.0
POISON_AFTER = 5    # deliveries after which a message whose handler keeps raising is terminated


class Verdict(enum.Enum):
    """What the consumer loop does with a message once the handler returns."""

    ACK = "ack"      # done (success or a terminal error already reported)
    NAK = "nak"      # retry later (after `delay`)
    TERM = "term"    # poison: never redeliver


@dataclass
class Delivery:
    """One message handed to a handler; the handler reads it and may extend its lease."""

    subject: str
    data: bytes
    headers: dict[str, str]
    num_delivered: int
    _msg: Msg
    nak_delay: float = 1.0
    msg: object = None          # the message decoded (bus/lanes.py `decoded`)
    tenant: str = ""            # whose it is, from the subject (bus/lanes.py `tenant_from_subject`)

    async def in_progress(self) -> None:
        """Tell the server the work goes on (resets the ack wait)."""
        try:
            await self._msg.in_progress()
        except Exception as exc:  # the lease is best effort; losing it means redelivery, which is idempotent
            log.debug("in_progress failed: %s", exc)


Handler = Callable[[Delivery], Awaitable[Verdict]]

LEASE_EVERY = 10.0   # seconds between in-progress acks (a third of streams.ACK_WAIT)


class Lease:
    """Extends a message's ack wait every `every` seconds until cancel(): a timer, not a task, since
    almost every piece of work ends long before the first tick."""

    def __init__(self, d: Delivery, every: float | None = None) -> None:
        self._d, self._every = d, every or LEASE_EVERY
        self._loop = asyncio.get_running_loop()
        self._handle = self._loop.call_later(self._every, self._tick)
        self._pending: asyncio.Future | None = None

    def _tick(self) -> None:
        self._pending = asyncio.ensure_future(self._d.in_progress())
        self._handle = self._loop.call_later(self._every, self._tick)

    def cancel(self) -> None:
        """Stop extending."""
        self._handle.cancel()


class PullWorker:
    """Runs handler for each message of one durable pull consumer, holding at most credit() at once."""

    def __init__(self, nc, stream: str, durable: str, handler: Handler, credit: Callable[[], int]) -> None:
        self._nc = nc
        self._next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self._handler = handler
        self._credit = credit
        self._inbox = nc.new_inbox()
        self._requests: collections.deque[list] = collections.deque()  # [remaining, expires_at]
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._sub = None
        self._loop_task: asyncio.Task | None = None
        self.in_flight = 0
        self.on_stop = lambda: None
        self._failures: dict[int, int] = {}   # stream seq -> handler exceptions (NAKs for room do not count)

    async def start(self) -> None:
        """Subscribe to the delivery inbox and start pulling."""
        self._sub = await self._nc.subscribe(self._inbox, cb=self._on_msg)
        self._loop_task = asyncio.create_task(self._pull_loop())

    def poke(self) -> None:
        """Credit may have grown: pull more."""
        self._wake.set()

    def reconnected(self) -> None:
        """The connection moved to another server: pull requests held by the old one are gone."""
        self._requests.clear()
        self._wake.set()

    async def stop(self, drain: bool = True) -> None:
        """Stop pulling; wait for handlers in flight (drain) or cancel them."""
        self.on_stop()
        if self._loop_task:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:
                pass
        if not drain:
            for t in self._tasks:
                t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _outstanding(self) -> int:
        now = time.monotonic()
        while self._requests and self._requests[0][1] < now:
            self._requests.popleft()   # expired without a status (lost on reconnect)
        return sum(r[0] for r in self._requests)

    async def _pull_loop(self) -> None:
        while True:
            want = self._credit() - self.in_flight - self._outstanding()
            if want > 0 and self._nc.is_connected:
                req = {"batch": want, "expires": int(PULL_EXPIRES * 1e9)}
                try:
                    await self._nc.publish(self._next_subject, json.dumps(req).encode(), reply=self._inbox)
                    self._requests.append([want, time.monotonic() + PULL_EXPIRES + 0.5])
                except Exception as exc:
                    log.debug("pull request failed: %s", exc)
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=PULL_EXPIRES / 2)
            except asyncio.TimeoutError:
                pass

    async def _on_msg(self, msg: Msg) -> None:
        hdrs = msg.headers or {}
        status = hdrs.get("Status")
        if status:
            # 408 request expired / 409 / 404: that request is over; drop it and ask again.
            if self._requests:
                self._requests.popleft()
            self._wake.set()
            return
        if self._requests:
            self._requests[0][0] -= 1
            if self._requests[0][0] <= 0:
                self._requests.popleft()
        self.in_flight += 1
        task = asyncio.create_task(self._run_one(msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_one(self, msg: Msg) -> None:
        try:
            meta = msg.metadata
            delivered, seq = meta.num_delivered, meta.sequence.stream
        except Exception:
            delivered, seq = 1, -1
        d = Delivery(msg.subject, msg.data, dict(msg.headers or {}), delivered, msg)
        verdict = Verdict.NAK
        try:
            verdict = await self._handler(d)
        except asyncio.CancelledError:
            verdict = Verdict.NAK
            raise
        except Exception:
            # A bug, not a transport hiccup: retry a few times, then stop the message going round.
            log.exception("handler failed on %s (delivery %d)", msg.subject, delivered)
            if len(self._failures) > 10_000:   # entries of messages finished elsewhere: start over
                self._failures.clear()
            failures = self._failures[seq] = self._failures.get(seq, 0) + 1
            verdict = Verdict.TERM if failures >= POISON_AFTER else Verdict.NAK
        finally:
            if verdict is not Verdict.NAK:
                self._failures.pop(seq, None)
            await self._settle(msg, verdict, d.nak_delay)
            self.in_flight -= 1
            self._wake.set()

    @staticmethod
    async def _settle(msg: Msg, verdict: Verdict, delay: float) -> None:
        try:
            if verdict is Verdict.ACK:
                await msg.ack()
            elif verdict is Verdict.TERM:
                await msg.term()
            else:
                await msg.nak(delay=delay)
        except Exception as exc:  # ack lost: redelivery follows and handlers are idempotent
            log.debug("settle %s failed: %s", verdict, exc)
