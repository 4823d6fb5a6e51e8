"""A node's create lane handed back to placement: at the edge's stop, and by the reaper for a lost node.

Every create waiting on the lane (also ones the node pulled and never acked: the lane's consumer is
made afresh, so they are deliverable at once) is published to placement again as attempt + 1. The
node's op lane is never drained by anyone else: a node that comes back serves its own ops (answering
those of sandboxes it no longer runs from their records), and clients learn of a lost sandbox from its
record and events.
"""
from __future__ import annotations

import logging
import time
from typing import Awaitable, Callable

import msgspec

from bus import streams, subjects
from bus.conn import Bus
from bus.messages import create_decoder, encode

log = logging.getLogger(__name__)

FENCE_EVERY = 0.25   # seconds between two checks that the lane may still be taken (see replace_creates)


async def replace_creates(bus: Bus, node: str, may_take: Callable[[], Awaitable[bool]] | None = None) -> int:
    """Send every create waiting on a node's lane back to placement, as attempt + 1; how many. With
    may_take (the reaper: is the node still the lost run?), asked first and every FENCE_EVERY seconds,
    taking stops as soon as the node came back: from then on the lane is its own again."""
    if may_take is not None and not await may_take():
        return 0
    count = 0
    checked = time.monotonic()

    async def again(data: bytes) -> bool | None:
        nonlocal count, checked
        if may_take is not None and time.monotonic() - checked > FENCE_EVERY:
            checked = time.monotonic()
            if not await may_take():
                return None   # stop: left for the node
        try:
            req = create_decoder.decode(data)
            subjects.token(req.tenant, "tenant")
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
            return True   # junk: drop it
        req = msgspec.structs.replace(req, node="", pool="", attempt=req.attempt + 1)
        await bus.publish(subjects.create_request(req.tenant, req.priority), encode(req),
                          msg_id=f"{req.request_id}.{req.attempt}", retries=3, retry_for=5.0)
        count += 1
        return True

    stream, config = streams.edge_create_consumer(node)
    await bus.delete_consumer(stream, config.durable_name)
    await bus.ensure_consumer(stream, config)
    await bus.take(stream, config.durable_name, again)
    return count
