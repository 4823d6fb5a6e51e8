"""Reading what streams store (a Bus mixin): whole subjects, single messages, durable pull consumers.

A read that stalls is an error, never an end: a listing that stops before the last stored message
raises BusError, so no caller mistakes a sick server for an empty subject.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import AsyncIterator

import nats.errors
from nats.js import api

from bus.errors import BusError
from bus.nats_errors import mapped_errors, not_found, timed_out


@dataclass
class Pulled:
    """One message of a DurableReader: its data, stream sequence and time, and its ack."""

    data: bytes
    seq: int
    at: float
    _msg: object
    pending: int = 0     # messages of the consumer still after this one when it was delivered

    @property
    def reply(self) -> str:
        """Its ack subject (what a reader acks it on)."""
        return self._msg.reply or ""

    async def ack(self) -> None:
        """Done with it: a durable consumer will not hand it out again."""
        with mapped_errors("ack"):
            await self._msg.ack()

    async def nak(self) -> None:
        """Not taken: handed out again at once (before what comes after it), not after the ack wait."""
        with mapped_errors("nak"):
            await self._msg.nak()


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
            if timed_out(exc):
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
class Stored:
    """One stored message: its stream sequence, data and headers."""

    seq: int
    data: bytes
    headers: dict[str, str] | None


class StreamReads:
    """Stream reads of a Bus (self.js is its JetStream context)."""

    js: object

    async def read_subject(self, stream: str, subject: str, *, timeout: float = 5.0,
                           with_headers: bool = False) -> AsyncIterator:
        """Every message stored on `subject` (wildcards allowed), oldest first, until caught up: its
        data, or (data, headers) with_headers. BusError when the read stalls before the end."""
        with mapped_errors(f"read {subject}"):
            sub = await self.js.subscribe(subject, stream=stream, ordered_consumer=True)
        got_any = False
        try:
            while True:
                try:
                    m = await sub.next_msg(timeout=timeout)
                except nats.errors.TimeoutError:
                    if not got_any and not await self._has_messages(stream, subject):
                        return   # nothing stored there
                    raise BusError(f"read {subject}: the stream stopped answering before the end") from None
                got_any = True
                yield (m.data, m.headers) if with_headers else m.data
                if m.metadata.num_pending == 0:
                    return
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _has_messages(self, stream: str, subject: str) -> bool:
        with mapped_errors(f"stream info {stream}"):
            info = await self.js.stream_info(stream, subjects_filter=subject)
        return bool(info.state.subjects)

    async def stored_after(self, stream: str, subject: str, seq: int = 0) -> Stored | None:
        """The first message stored on `subject` (no wildcards needed) with a stream sequence above
        `seq`, read from the stream leader; None when there is none. BusError when it cannot say."""
        try:
            with mapped_errors(f"get next of {subject}"):
                m = await self.js.get_msg(stream, seq=seq + 1, subject=subject, next=True)
        except BusError as exc:
            if not_found(exc):
                return None
            raise
        return Stored(m.seq, m.data or b"", m.headers)

    async def last_on_subject(self, stream: str, subject: str, *, with_headers: bool = False):
        """The last message stored on a subject (its data, or (data, headers) with_headers), or None."""
        try:
            with mapped_errors(f"last of {subject}"):
                m = await self.js.get_last_msg(stream, subject)
        except BusError as exc:
            if not_found(exc):
                return None
            raise
        return (m.data, m.headers) if with_headers else m.data

    async def delete_msg(self, stream: str, seq: int) -> bool:
        """Remove one message by its stream sequence; False when it is not there (consumed, or never was)."""
        try:
            with mapped_errors(f"delete {stream}#{seq}"):
                return bool(await self.js.delete_msg(stream, seq))
        except BusError as exc:
            if not_found(exc) or "no message found" in str(exc).lower():
                return False
            raise

    async def consumer_descriptions(self, stream: str) -> list[str]:
        """The description of every consumer on a stream (the server lists 256 a page)."""
        out: list[str] = []
        while True:
            with mapped_errors(f"consumers of {stream}"):
                page = await self.admin.consumers_info(stream, offset=len(out) or None)
            out += [(c.config.description or "") if c.config else "" for c in page]
            if len(page) < 256:
                return out

    async def durable_reader(self, stream: str, config: api.ConsumerConfig) -> DurableReader:
        """A pull consumer read in batches by its holder (who acks): trajectory consumers. A durable
        one resumes where it was left, after any restart."""
        with mapped_errors(f"consumer {config.durable_name or 'ephemeral'}"):
            if config.durable_name:
                await self.admin.add_consumer(stream, config)
                sub = await self.admin.pull_subscribe_bind(config.durable_name, stream)
            else:
                sub = await self.admin.pull_subscribe(config.filter_subject, stream=stream, config=config)
        return DurableReader(sub)
