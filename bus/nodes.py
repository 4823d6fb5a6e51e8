"""Node records (KV dsec-nodes) as both sides read them, and the flags written on them.

A node record has several writers, each owning its fields, all by compare-and-set on the revision:
the edge (capacity, usage, heartbeat, taken bookings: edge/noderecord.py), placement (bookings:
placement/ledger.py), an operator (`draining`) and the reaper (`lost`), the last two through set_flag.
"""
from __future__ import annotations

import time

import msgspec

from bus import streams
from bus.conn import Bus
from bus.messages import encode
from bus.records import NodeInfo, node_decoder


def decode_node(key: str, raw: bytes | None) -> NodeInfo | None:
    """A node record, or None for junk or a record filed under another node's key."""
    if raw is None:
        return None
    try:
        info = node_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return info if info.node == key else None


async def set_flag(bus: Bus, node: str, *, draining: bool | None = None, stopping: bool | None = None,
                   lost: bool | None = None,
                   lost_handled: bool | None = None, only_if_stale: float | None = None,
                   retry_lost_after: float | None = None) -> NodeInfo | None:
    """Set a node's draining / lost / lost_handled flag by compare-and-set (draining with stopping: its own
    edge's stop's, which its next start clears; without: an operator's, which a restart keeps). With only_if_stale, lost is
    set only while the heartbeat is older than that many seconds and the node is not lost already (so
    exactly one engine wins the claim); declaring a node lost drops its bookings (their creates are
    placed again). With retry_lost_after, an unfinished lost-node job older than that is taken over
    (lost_at refreshed). Returns the record written, or None when nothing was written."""
    def mutate(raw: bytes | None) -> bytes | None:
        info = decode_node(node, raw)
        if info is None:
            return None
        if only_if_stale is not None and (info.lost or time.time() - info.heartbeat < only_if_stale):
            return None
        if lost_handled is not None and not info.lost:
            return None   # it came back meanwhile
        if retry_lost_after is not None:   # take over an unfinished lost-node job (one engine wins)
            if not info.lost or info.lost_handled or time.time() - info.lost_at < retry_lost_after:
                return None
            return encode(msgspec.structs.replace(info, lost_at=time.time()))
        new = info
        if draining is not None:   # (a stop over an operator's drain leaves it the operator's)
            own = bool(stopping) and not (info.draining and not info.stopping)
            new = msgspec.structs.replace(new, draining=draining, stopping=own)
        if lost:
            new = msgspec.structs.replace(new, lost=True, lost_at=time.time(), lost_handled=False, bookings={})
        if lost_handled is not None:
            new = msgspec.structs.replace(new, lost_handled=lost_handled)
        return None if new == info else encode(new)

    result = await bus.kv_update(streams.NODES_KV, node, mutate)
    return node_decoder.decode(result.value) if result.written and result.value else None
