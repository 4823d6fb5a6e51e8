"""JetStream publishes that do not wait: each gets a future of its ack, on one reply inbox per connection.

nats-py's own publish_async takes a permit before it publishes and never gives it back when the publish
itself fails (a connection closed, a reconnect buffer full): after enough of those every later publish
blocks for good. Here a future exists only for a publish that went out, and one whose ack never comes
is dropped by whoever waits for it (see Bus.stored), so nothing accumulates.
"""
from __future__ import annotations

import asyncio
import itertools
import json

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg


class AckedPublisher:
    """Publishes into JetStream and hands back a future of each publish's stream sequence."""

    def __init__(self, nc) -> None:
        self._nc = nc
        self._prefix = ""
        self._futures: dict[str, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._sub = None

    async def _ensure(self) -> None:
        if self._sub is None:
            self._prefix = self._nc.new_inbox()
            self._sub = await self._nc.subscribe(f"{self._prefix}.*", cb=self._on_ack)

    async def publish(self, subject: str, data: bytes, headers: dict[str, str] | None) -> asyncio.Future:
        """Publish now; the future resolves to the stream seq, or fails with nats-py's error."""
        await self._ensure()
        token = str(next(self._ids))
        fut = asyncio.get_running_loop().create_future()
        self._futures[token] = fut
        fut.add_done_callback(lambda _f: self._futures.pop(token, None))
        try:
            await self._nc.publish(subject, data, reply=f"{self._prefix}.{token}", headers=headers)
        except BaseException:
            self._futures.pop(token, None)
            fut.cancel()
            raise
        return fut

    async def _on_ack(self, msg: Msg) -> None:
        fut = self._futures.pop(msg.subject.rsplit(".", 1)[-1], None)
        if fut is None or fut.done():
            return
        if msg.headers and msg.headers.get("Status") == "503":
            fut.set_exception(nats.js.errors.NoStreamResponseError())
            return
        try:
            resp = json.loads(msg.data)
        except ValueError as exc:
            fut.set_exception(nats.errors.Error(f"bad publish ack: {exc}"))
            return
        if "error" in resp:
            fut.set_exception(nats.js.errors.APIError.from_error(resp["error"]))
        else:
            fut.set_result(int(resp.get("seq", 0)))

    @property
    def outstanding(self) -> int:
        """Publishes whose ack is awaited."""
        return len(self._futures)
