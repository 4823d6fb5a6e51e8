"""Lost nodes: a node that is really silent is taken out of placement and its work is accounted for.

A node is lost when neither its core heartbeats (dsec.hb.<node>, every HEARTBEAT_EVERY, no JetStream
leader needed) nor its record's heartbeat (KV dsec-nodes) were heard for NODE_LOST_AFTER, and only
while this engine itself is healthy: it hears its own probe (its connection works), has not
reconnected or stalled lately. A node bucket without a leader, or a server paused under the engine,
is the bus being sick, not nodes being dead.

Every engine looks; the one whose compare-and-set flips the node's record to `lost` (only while its
record's heartbeat is still stale and the flag unset) does the work, for that run of the node (its
started_at, which every sandbox record of it carries as `epoch`):
- every sandbox record of that run that says ready becomes node_lost, with its event and trajectory
  record (edge/records.py: the same writer's rules), `starting` claims are freed;
- creates waiting on the node's lane are placed again (attempt + 1) on a live node.
Both stop as soon as the node is back (a new run, or its heartbeat clears the flag): what it started
since is its own, and it serves its own op lane (ops of sandboxes it no longer runs are answered from
their records). Clients waiting on a lost sandbox learn it from its record and events.
"""
from __future__ import annotations

import asyncio
import logging
import time

from bus import streams, subjects
from bus.conn import Bus
from bus.errors import DsecError
from bus.nodes import decode_node, set_flag
from edge.lanes import replace_creates
from edge.records import Outcome, SandboxRecords, decode_record, key_of
from placement.ledger import NodeLedger

log = logging.getLogger(__name__)

SWEEP_EVERY = 1.0
STILL_LOST_EVERY = 50   # records rewritten between two checks that the node is still lost
RETRY_AFTER = 10.0   # a lost node still not handled this long after its claim is handled by any engine
STALL = 0.5          # a sweep this much later than due means this engine itself was stalled
STALL_GRACE = 5      # after a stall, sweeps on time before a node may be declared lost (two heartbeats)
PROBE_EVERY = 0.25   # seconds between two of this engine's own probes
DEAF_AFTER = 1.5     # no own probe heard for this long: this engine's connection is sick


class Reaper:
    """Runs inside every placement engine."""

    def __init__(self, bus: Bus, ledger: NodeLedger, name: str = "reaper") -> None:
        self.bus = bus
        self.ledger = ledger
        self.records = SandboxRecords(bus, "")
        self.probe = subjects.engine_probe(subjects.token(name, "engine name") if subjects.is_token(name) else "reaper")
        self.heard_self = time.monotonic()
        self._sub = None
        self._forget = lambda: None
        self.calm = STALL_GRACE   # sweeps on time since this engine was last unwell
        self.lost_nodes = 0
        self.lost_sandboxes = 0
        self.replaced = 0

    async def start(self) -> list[asyncio.Task]:
        """Listen to this engine's own probe and to reconnects; returns the tasks to cancel at stop."""
        async def _heard(_data: bytes, _subject: str) -> None:
            self.heard_self = time.monotonic()
        self._sub = await self.bus.subscribe(self.probe, _heard)
        self._forget = self.bus.on_reconnect(self._unwell)
        return [asyncio.create_task(self._probe()), asyncio.create_task(self.run())]

    def subscriptions(self) -> list:
        """What start() subscribed (the engine unsubscribes at its stop); the reconnect hook goes too."""
        self._forget()
        return [self._sub] if self._sub is not None else []

    def _unwell(self) -> None:
        self.calm = 0

    async def _probe(self) -> None:
        while True:
            try:
                await self.bus.send(self.probe, b"")
            except DsecError:
                pass
            await asyncio.sleep(PROBE_EVERY)

    def hears_itself(self) -> bool:
        """Whether this engine's own probe came back lately (its connection works)."""
        return time.monotonic() - self.heard_self < DEAF_AFTER

    def healthy(self) -> bool:
        """Whether this engine may judge others' silence: it hears itself and was calm lately."""
        return self.calm >= STALL_GRACE and self.hears_itself()

    async def run(self) -> None:
        """Sweep forever; no failure ends the sweep. After a stall of this engine itself (a paused process,
        a starved event loop, a reconnect, its own probe unheard), nodes get STALL_GRACE sweeps to be heard
        from before any is declared lost: their heartbeats may have been late because of us. The grace
        counts sweeps that ran on time, not seconds: a process paused again and again never judges others
        by its own pauses."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(SWEEP_EVERY)
            tick = time.monotonic()
            if tick - last > SWEEP_EVERY + STALL or tick - self.heard_self > DEAF_AFTER:
                if self.calm >= STALL_GRACE:
                    log.warning("placement unwell (stalled %.1fs, own probe %.1fs ago): no node is declared lost "
                                "for its next %d sweeps", tick - last, tick - self.heard_self, STALL_GRACE)
                self.calm = 0
            else:
                self.calm += 1
            last = tick
            now = time.time()
            for info in self.ledger.nodes():
                try:
                    if (not info.lost and now - info.heartbeat > streams.NODE_LOST_AFTER
                            and self.ledger.silent_for(info.node) > streams.NODE_LOST_AFTER and self.healthy()):
                        await self.claim(info.node)
                    elif info.lost and not info.lost_handled and now - info.lost_at > RETRY_AFTER:
                        won = await set_flag(self.bus, info.node, retry_lost_after=RETRY_AFTER)
                        if won is not None:
                            await self.finish(info.node, won.started_at, again=True)   # its claimer died midway
                except Exception as exc:
                    log.warning("lost node %s not handled yet: %s", info.node, exc)

    async def claim(self, node: str) -> bool:
        """Declare node lost if its heartbeat is still stale and nobody did; then account for its work."""
        won = await set_flag(self.bus, node, lost=True, only_if_stale=streams.NODE_LOST_AFTER)
        if won is None:
            return False
        self.lost_nodes += 1
        log.warning("node %s lost (no heartbeat for %.0fs)", node, time.time() - won.heartbeat)
        await self.finish(node, won.started_at)
        return True

    async def finish(self, node: str, epoch: float, again: bool = False) -> None:
        """The work for a lost run of a node; every step may run again (after a crash midway) without harm."""
        if await self._mark_sandboxes(node, epoch, again):
            self.replaced += await replace_creates(self.bus, node, lambda: self._still_lost(node, epoch))
        await set_flag(self.bus, node, lost_handled=True)

    async def _mark_sandboxes(self, node: str, epoch: float, again: bool) -> bool:
        """Every record of the lost run: `ready` -> `node_lost` (with its event), `starting` -> freed. Each by
        compare-and-set on the revision read, and only while the node is still that lost run: a node that
        comes back writes its own records, and those win. False when it came back."""
        checked = 0
        for key, raw in await self.bus.kv_items(streams.SANDBOXES_KV):
            rec = decode_record(raw)
            if rec is None or rec.node != node or key_of(rec) != key or rec.epoch > epoch:
                continue
            if rec.state == "node_lost" and again:   # marked by an engine that died before announcing it
                await self.records.announce_lost(rec)
                continue
            if rec.state not in ("ready", "starting"):
                continue
            checked += 1
            if checked % STILL_LOST_EVERY == 1 and not await self._still_lost(node, epoch):
                return False   # it came back: its own records win from here on
            now_rec, revision = await self.records.get(rec.tenant, rec.sandbox_id)
            if now_rec != rec:
                continue   # changed since the listing: its writer knows better
            if rec.state == "starting":   # never started: free the id (that claim only), placed again below
                await self.records.free_claim(rec.tenant, rec.sandbox_id, node, revision)
                continue
            if await self.records.mark_lost(rec, revision, f"node {node} stopped heartbeating") is Outcome.WRITTEN:
                self.lost_sandboxes += 1
        return await self._still_lost(node, epoch)

    async def _still_lost(self, node: str, epoch: float) -> bool:
        info = decode_node(node, await self.bus.kv_get(streams.NODES_KV, node))
        return info is not None and info.lost and info.started_at == epoch
