"""Lost nodes: a node whose heartbeat stopped is taken out of placement and its work is accounted for.

Every engine looks; the one whose compare-and-set flips the node's record to `lost` (only while the
heartbeat is still stale and the flag unset) does the work, exactly once:
- every sandbox KV says runs there becomes `node_lost`, with an event (clients attached to it get
  SandboxNotFound(reason="node_lost"));
- creates waiting on the node's lane are placed again (attempt + 1) on a live node;
- ops waiting on its op lane are answered with sandbox_not_found / node_lost, so no caller hangs.
A node that comes back (same id) reconciles at start and clears the flag with its first heartbeat.
"""
from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from bus import streams, subjects
from bus.conn import Bus
from bus.errors import SandboxNotFound
from bus.messages import (ErrorReply, Event, ExecRequest, ExitRecord, TrajRecord, create_decoder, encode,
                          op_decoder, sandbox_decoder)
from placement.ledger import NodeLedger, set_flag

log = logging.getLogger(__name__)

SWEEP_EVERY = 1.0
STILL_LOST_EVERY = 50   # records rewritten between two checks that the node is still lost
RETRY_AFTER = 10.0   # a lost node still not handled this long after its claim is handled by any engine
STALL = 0.5          # a sweep this much later than due means this engine itself was stalled
STALL_GRACE = 5      # after a stall, sweeps on time before a node may be declared lost (two heartbeats)


class Reaper:
    """Runs inside every placement engine."""

    def __init__(self, bus: Bus, ledger: NodeLedger) -> None:
        self.bus = bus
        self.ledger = ledger
        self.lost_nodes = 0
        self.lost_sandboxes = 0
        self.replaced = 0

    async def run(self) -> None:
        """Sweep forever; no failure ends the sweep. After a stall of this engine itself (a paused process,
        a starved event loop), nodes get STALL_GRACE sweeps to be heard from before any is declared lost: their
        heartbeats may have been late because of us (an edge in this process) or unread by us. The grace
        counts sweeps that ran on time, not seconds: a process paused again and again never judges others
        by its own pauses."""
        last, calm = time.monotonic(), STALL_GRACE   # calm: sweeps on time since the last stall
        while True:
            await asyncio.sleep(SWEEP_EVERY)
            tick = time.monotonic()
            if tick - last > SWEEP_EVERY + STALL:
                log.warning("placement stalled for %.1fs: no node is declared lost for its next %d sweeps",
                            tick - last, STALL_GRACE)
                calm = 0
            else:
                calm += 1
            last = tick
            now = time.time()
            for info in self.ledger.nodes():
                try:
                    if not info.lost and now - info.heartbeat > streams.NODE_LOST_AFTER and calm >= STALL_GRACE:
                        await self.claim(info.node)
                    elif info.lost and not info.lost_handled and now - info.lost_at > RETRY_AFTER:
                        if await set_flag(self.bus, info.node, retry_lost_after=RETRY_AFTER):
                            await self.finish(info.node)   # the engine that claimed it died midway
                except Exception as exc:
                    log.warning("lost node %s not handled yet: %s", info.node, exc)

    async def claim(self, node: str) -> bool:
        """Declare node lost if its heartbeat is still stale and nobody did; then account for its work."""
        won = await set_flag(self.bus, node, lost=True, only_if_stale=streams.NODE_LOST_AFTER)
        if won is None:
            return False
        self.lost_nodes += 1
        log.warning("node %s lost (no heartbeat for %.0fs)", node, time.time() - won.heartbeat)
        await self.finish(node)
        return True

    async def finish(self, node: str) -> None:
        """The work for a lost node; every step may run again (after a crash midway) without harm."""
        await self._mark_sandboxes(node)
        await self._replace_creates(node)
        await self._answer_ops(node)
        await set_flag(self.bus, node, lost_handled=True)

    async def _mark_sandboxes(self, node: str) -> None:
        """Every record of the node: `ready` -> `node_lost` (with an event), `starting` -> freed. Each by
        compare-and-set on the revision read, and only while the node is still lost: an edge that comes
        back (or was wrongly declared lost) writes its own records, and those win."""
        now = time.time()
        checked = 0
        for key, raw in await self.bus.kv_items(streams.SANDBOXES_KV):
            try:
                rec = sandbox_decoder.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            if rec.node != node or rec.sandbox_id != key or rec.state not in ("ready", "starting"):
                continue
            checked += 1
            if checked % STILL_LOST_EVERY == 1 and not await self._still_lost(node):
                return   # it came back: its own records win from here on
            raw, revision = await self.bus.kv_entry(streams.SANDBOXES_KV, key)
            if raw is None or sandbox_decoder.decode(raw) != rec:
                continue   # changed since the listing: its writer knows better
            if rec.state == "starting":   # never started: free the id, its create is placed again below
                await self.bus.kv_cas_delete(streams.SANDBOXES_KV, key, revision)
                continue
            gone = msgspec.structs.replace(rec, state="node_lost", reason=f"node {node} stopped heartbeating",
                                           updated_at=now)
            if await self.bus.kv_cas(streams.SANDBOXES_KV, key, encode(gone), revision) is None:
                continue
            await self.bus.publish(subjects.event(rec.tenant, key), Event(
                type="node_lost", sandbox_id=key, tenant=rec.tenant, node=node, at=now, detail=gone.reason),
                msg_id=f"{key}.node_lost.{node}", retry_for=5.0)
            job = subjects.job_of(rec.labels)
            await self.bus.publish(subjects.trajectory(rec.tenant, job, key), TrajRecord(
                id=f"{key}.node_lost", type="node_lost", sandbox_id=key, tenant=rec.tenant, job=job, node=node,
                at=now, detail=gone.reason), msg_id=f"{key}.node_lost.{node}.traj", retry_for=5.0)
            self.lost_sandboxes += 1

    async def _still_lost(self, node: str) -> bool:
        raw = await self.bus.kv_get(streams.NODES_KV, node)
        from placement.ledger import decode_node
        info = decode_node(node, raw)
        return info is not None and info.lost

    async def _replace_creates(self, node: str) -> None:
        self.replaced += await replace_creates(self.bus, node)

    async def _answer_ops(self, node: str) -> None:
        await answer_ops(self.bus, node, f"node {node} was lost", "node_lost")


async def replace_creates(bus: Bus, node: str) -> int:
    """Send every create waiting on a node's lane (also ones it pulled and never acked) back to placement,
    as attempt + 1. Returns how many."""
    count = 0

    async def again(data: bytes) -> bool:
        nonlocal count
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

    await _take(bus, streams.edge_create_consumer(node), again)
    return count


async def answer_ops(bus: Bus, node: str, why: str, reason: str) -> None:
    """Answer every op waiting on a node's lane with sandbox_not_found (reason), so no caller hangs."""
    async def answer(data: bytes) -> bool:
        try:
            op = op_decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return True
        try:
            if isinstance(op, ExecRequest):
                subjects.token(op.sandbox_id, "sandbox_id"), subjects.token(op.exec_id, "exec_id")
                await bus.publish(subjects.output(op.sandbox_id, op.exec_id), ExitRecord(
                    exec_id=op.exec_id, seq=1, exit_code=-1, error_code=SandboxNotFound.code, error=why,
                    reason=reason))
            elif subjects.is_reply_subject(op.reply_to):
                await bus.send(op.reply_to, ErrorReply(request_id=op.request_id, code=SandboxNotFound.code,
                                                       message=why, reason=reason))
        except ValueError:
            pass
        return True

    await _take(bus, streams.edge_ops_consumer(node), answer)


async def _take(bus: Bus, stream_and_config, handle) -> None:
    """Everything waiting on a node's lane, including what it had pulled and not acked: the consumer is
    made afresh (its unacked messages are then deliverable at once)."""
    stream, config = stream_and_config
    await bus.delete_consumer(stream, config.durable_name)
    await bus.ensure_consumer(stream, config)
    await bus.take(stream, config.durable_name, handle)
