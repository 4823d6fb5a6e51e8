"""The edge: a node agent. Pulls its own create lane (only as many as it has room for) and op lane.

It is made of narrow parts: the create lanes (edge/creates.py), the op lane's dispatch (edge/ops.py),
Chronus for execs (chronus/execs.py), the running sandboxes and their lifecycle (edge/sandboxes.py),
the one writer of their records (edge/records.py) through a durable outbox (edge/outbox.py), the
node record and heartbeats (edge/noderecord.py), warm pools and the layer cache. This module starts,
stops and wires them, enforces TTLs and reacts to being drained or declared lost.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import subprocess
import time
from pathlib import Path

import msgspec

from bus import lanes, streams, subjects
from bus.conn import Bus
from bus.errors import BusError, EnvironmentFailure
from bus.messages import create_decoder
from bus.records import SandboxRecord
from bus.nodes import set_flag
from chronus.execs import ExecLimits, Execs
from chronus.orphans import ExecJournal, Left
from edge.backends.base import Backend, BackendError
from edge.backends.registry import BackendSet
from edge.calls import CallLane
from edge.capacity import Capacity, EdgeConfig, default_slots
from edge.creates import CreateLane
from edge.fence import FENCE_AFTER, EdgeFence, stamp_of
from edge.lanes import replace_creates
from edge.network import NodeNetwork
from edge.layercache import LayerCache
from edge.noderecord import NodeRecord
from edge.ops import OpLane
from edge.outbox import Outbox
from edge.records import SandboxRecords, decode_record, key_of, lifecycle
from edge.sandboxes import Running, Sandboxes
from edge.warmpool import WarmPools

log = logging.getLogger(__name__)


def filesystem_of(path: Path) -> str:
    """The type of the filesystem path lies on, or will when made (`stat -f`; "" when it cannot be told)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


BUS_CLEANUP_TIMEOUT = 1.0   # cleanup never waits on the bus longer than this
STOP_BUS_BUDGET = 1.5       # seconds for everything a stop does before the backend's clean-up
HAND_BACK_BUDGET = 1.2      # seconds for handing waiting creates back at a stop
OUTBOX_DRAIN = 1.5          # seconds a stop waits for the outbox to empty (what is left: next start)
TTL_EVERY = 0.5             # seconds between two looks for expired sandboxes
MEMORY_PRUNE_EVERY = 30.0   # seconds between two looks for memory snapshots whose snapshot was deleted
LOST_AT_ONCE = 32           # sandboxes a restart reports node_lost at once (each: its left execs, then its record)
REFRESH_EVERY = 60.0        # seconds between two looks for records the sandboxes bucket would soon drop:
REFRESH_AT = 0.25           # those last written this share of its age ago are written again,
REFRESH_MAX = 500           # at most this many a look


class Edge:
    """One node agent over its backends, held by kind (a BackendSet); it owns none of their details."""

    def __init__(self, bus: Bus, backend: Backend | BackendSet, config: EdgeConfig, state_dir: Path) -> None:
        self.bus = bus
        if not isinstance(backend, BackendSet):   # one backend: a set of one
            backend = BackendSet({backend.kind: backend})
        self.backend = backend
        config = msgspec.structs.replace(config, backends=backend.kinds)   # it advertises what it runs
        if config.slots <= 0:
            slots, cap = default_slots(config.memory)
            config = msgspec.structs.replace(config, slots=slots)
            log.info("node %s: %d slots (memory / 1 MiB, capped by %s)", config.node_id, slots, cap)
        self.config = config
        self.node = subjects.token(config.node_id, "node id")
        self.capacity = Capacity(config)
        self.state_dir = Path(state_dir)
        self.record = NodeRecord(bus, self.capacity, self._set_draining, self._declared_lost,
                                 inventory=lambda: dict(warm=self.warm.stock(), layers=self.layers.held()))
        self.epoch = self.record.started_at   # this run of the edge (its records carry it)
        self.outbox = Outbox(self.state_dir / "outbox.log", lambda c, replayed, early: self.records.apply(c, replayed, early))
        self.records = SandboxRecords(bus, self.node, self.outbox)
        self.layers = LayerCache(bus, self.state_dir / "layer-cache", config.layer_cache, in_use=lambda: {
            la.digest for r in self.sandboxes.values() for la in r.layers} | self.warm.digests(),
            on_change=lambda: self.record.changed(), lazy=config.lazy_layers, lazy_fill=config.lazy_fill)
        self.box = Sandboxes(bus, self.node, backend, self.records, self.layers, self.state_dir,
                             released=self._released, settle=lambda sid: self.execs.settle(sid))
        self.execs = Execs(bus, self.node, self.box, ExecLimits(config.max_output, config.traj_output,
                                                               config.max_execs),
                           ExecJournal(self.state_dir / "execs", stamp_of(self.state_dir)))
        self.ops = OpLane(bus, self.node, config.max_execs, self.execs, self.box)
        self.calls: CallLane | None = None   # when it runs fncall workers (set up at start)
        self.warm = WarmPools(bus, self.node, pool=config.pool, warm_max=config.warm_max, capacity=self.capacity,
                              layers=self.layers, backend=backend, changed=self.record.changed,
                              busy=lambda: bool(self.creates.creating), draining=lambda: self.draining)
        self.creates = CreateLane(bus, self.node, self.epoch, capacity=self.capacity, node_record=self.record,
                                  records=self.records, sandboxes=self.box, layers=self.layers, backend=backend,
                                  warm=self.warm, draining=lambda: self.draining)
        self.network = NodeNetwork(self.node, config, self.box, self.state_dir)
        self.ops.network = self.network
        self.fence = EdgeFence(self.node, self.state_dir)
        self._create_worker = None
        self._pool_worker = None
        self._dropped = None   # the core subscription to deleted snapshots' layers
        self._tasks: list[asyncio.Task] = []
        self._expiring: set[asyncio.Task] = set()   # TTL destroys in flight

    @property
    def sandboxes(self) -> dict[str, Running]:
        """The sandboxes this edge runs, by id."""
        return self.box.running

    @property
    def created(self) -> int:
        """Sandboxes started here so far."""
        return self.creates.created

    @property
    def failed(self) -> int:
        """Creates that failed here so far."""
        return self.creates.failed

    @property
    def creating(self) -> bool:
        """Whether a create is being served now."""
        return bool(self.creates.creating)

    @property
    def draining(self) -> bool:
        """Drained by an operator: takes no new sandbox; the running ones finish."""
        return self.record.draining

    # ---- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Reconcile leftovers, apply what the outbox kept, report lost sandboxes, heartbeat, take work."""
        fs = await asyncio.to_thread(filesystem_of, self.state_dir)
        if fs in ("tmpfs", "ramfs"):   # (it said ready, then every create failed "Block device required": N)
            raise EnvironmentFailure(f"edge {self.node} cannot start: its state dir {self.state_dir} is on {fs}, "
                                     "which cannot back its EROFS layer mounts; use a disk filesystem (ext4, xfs, "
                                     "btrfs)")
        try:
            await self.backend.start()
        except BackendError as exc:
            raise EnvironmentFailure(f"edge {self.node} cannot start: {exc}") from exc
        self.capacity.accel = getattr(self.backend, "accelerators", {})
        self.backend.died = self._died
        self.layers.reconcile()          # after the backends unmounted what a dead run left on its files
        await self.network.start()
        self.backend.network = self.network.aether
        if self.backend.kinds != self.config.backends:   # a backend it only found did not start: not offered
            self.config = msgspec.structs.replace(self.config, backends=self.backend.kinds)
            self.capacity.config = self.config
        replayed = await self.outbox.open()
        await self._report_lost({c.sandbox_id: c.record for c in replayed if c.record is not None},
                                {c.sandbox_id for c in replayed if c.record is not None and c.over_claim})
        # Messages a crashed run of this node had pulled but not acked would wait out the ack wait
        # (30 s) before redelivery; no one else serves this node (its lock), so start the lanes afresh.
        for stream, config in (streams.edge_create_consumer(self.node), streams.edge_ops_consumer(self.node)):
            await self.bus.delete_consumer(stream, config.durable_name)
        await self.record.write()
        self.record.start(self.config.heartbeat)
        self._tasks = [asyncio.create_task(self._ttl_loop())]
        self.fence.start()   # (its sandboxes ended when this edge stops running: edge/fence.py)
        await self.ops.start()
        fncall = self.backend.backends.get("fncall")
        if fncall is not None:
            self.calls = CallLane(self.bus, self.node, fncall, self.layers)
            fncall.on_free = self.calls.poke
            await self.calls.start()
        await self.warm.start()
        self._dropped = await self.bus.subscribe(subjects.layer_dropped(), self._layer_dropped)
        steps = [lanes.counted(self.creates.outcomes), lanes.decoded(self.bus, create_decoder, "create")]
        self._create_worker = await self.bus.pull_worker(streams.edge_create_consumer(self.node),
                                                         self.creates.on_node_create, credit=self._create_credit,
                                                         steps=steps)
        # The pool's shared lane (cloud bursting): every edge of the pool competes for it.
        self._pool_worker = await self.bus.pull_worker(streams.pool_create_consumer(self.config.pool),
                                                       self.creates.on_pool_create, credit=self._pool_credit,
                                                       steps=steps)

    async def _report_lost(self, pending: dict[str, SandboxRecord], claimed: set[str] = frozenset()) -> None:
        """Sandboxes KV (or the outbox a crashed run left) says run here that the reconcile just removed:
        node_lost (through the outbox, after any change of them the log held), never silently leaked; a
        crashed run's `starting` claims are freed."""
        changes = []
        seen: set[str] = set()
        left = collections.defaultdict(list)
        for entry in self.execs.journal.left():
            left[entry.op.sandbox_id].append(entry)
        turns = asyncio.Semaphore(LOST_AT_ONCE)

        async def lost(rec: SandboxRecord, entries: list[Left], lose: bool) -> None:
            """One sandbox: the execs a dead run left running ended first, then its node_lost. Each sandbox
            on its own: one after another, a sandbox's callers were told node_lost by its exit records up to
            1.9 s before its record said so (20 sandboxes, helper F3)."""
            async with turns:
                for entry in entries:
                    await self._close_left(entry, rec)
                if lose:
                    await self._lost(rec)
        for key, raw in await self.bus.kv_items(streams.SANDBOXES_KV):
            rec = decode_record(raw)
            if rec is None or rec.node != self.node or key_of(rec) != key:
                continue
            seen.add(rec.sandbox_id)
            entries = left.pop(rec.sandbox_id, [])
            base = pending.get(rec.sandbox_id)
            if base is not None and base.version > rec.version:
                rec = base   # the outbox holds a newer state of it: node_lost follows that one
            if rec.state == "ready" or entries:
                changes.append(lost(rec, entries, rec.state == "ready"))
            if rec.state == "starting" and base is None:
                await self.records.free_claim(rec.tenant, rec.sandbox_id)
        for entries in left.values():   # (of a sandbox with no record here: nothing to put them on)
            for entry in entries:
                log.warning("exec %s of sandbox %s left by a dead run: its sandbox has no record", entry.op.exec_id,
                            entry.op.sandbox_id)
                self.execs.journal.end(entry.op.exec_id)
        for key, rec in pending.items():   # only in the log (a warm claim's ready never stored). Not one over a
            if key not in seen and rec.state == "ready" and key not in claimed:   # claim now gone: the reaper freed it
                changes.append(self._lost(rec))                              # and placed its request again
        await asyncio.gather(*changes)

    async def _close_left(self, entry: Left, rec: SandboxRecord) -> None:
        """An exec a dead run left running: its exit record stored, its trajectory record on the sandbox's
        timeline (durably, before the node_lost that follows), then out of the journal."""
        try:
            messages = await self.execs.close_left(entry, rec)
        except BusError as exc:   # (kept: the next start tries again)
            log.warning("exec %s left by a dead run not closed: %s", entry.op.exec_id, exc)
            return
        await self.box.timeline(rec.sandbox_id, messages)
        self.execs.journal.end(entry.op.exec_id)

    def _lost(self, rec: SandboxRecord):
        gone = msgspec.structs.replace(rec, state="node_lost", reason="edge restarted; sandbox destroyed by reconcile",
                                       updated_at=time.time(), version=rec.version + 1, suspended=False)
        return self.records.change(gone, terminal_event=True, publishes=lifecycle(
            gone, "node_lost", node=self.node, detail=gone.reason))

    def _set_draining(self, draining: bool) -> None:
        log.info("node %s %s", self.node, "draining" if draining else "accepting work again")
        self._poke()

    def _declared_lost(self, why: str = "node was declared lost") -> None:
        """Placement declared this node lost while it ran (no heartbeat of it was heard for too long): its
        sandboxes were reported node_lost and its waiting creates placed elsewhere, so the ones it still
        runs are destroyed, as a restart would (their execs end SandboxNotFound(node_lost)); then it
        serves afresh."""
        log.error("node %s: %s; destroying its %d sandboxes", self.node, why, len(self.sandboxes))
        for sid in list(self.sandboxes):
            self._tasks.append(asyncio.create_task(self._destroy_quietly(sid, "node_lost", why)))

    def _died(self, sandbox_id: str, why: str) -> None:
        """A sandbox ended by itself (its VM's kernel crashed or powered off): destroyed as failed, so its
        record and its execs say so instead of waiting for its TTL. A warm one leaves its pool's stock."""
        if self.warm.died(sandbox_id, why):
            return
        if self.fence.marked():   # its fence killed it while this edge did not run: node_lost, as all of them
            return                # (the TTL loop's next look ends them so)
        if sandbox_id in self.sandboxes and not self.sandboxes[sandbox_id].ending:
            log.warning("sandbox %s ended by itself: %s", sandbox_id, why)
            running = self.sandboxes[sandbox_id]
            running.ending, running.ending_why = "failed", why   # now: the execs it cut short say so
            task = asyncio.create_task(self._destroy_quietly(sandbox_id, "failed", why))
            self._expiring.add(task)
            task.add_done_callback(self._expiring.discard)

    async def _destroy_quietly(self, sandbox_id: str, state: str, reason: str) -> None:
        try:
            await self.box.destroy(sandbox_id, state=state, reason=reason)
        except KeyError:
            pass
        except Exception:
            log.exception("destroy of %s failed", sandbox_id)

    def _released(self, sandbox_id: str) -> None:
        """A sandbox no longer runs: its room is free (and a deleted snapshot's layer it used can go)."""
        self.capacity.release(sandbox_id)
        self.layers.sweep()
        self.record.changed()
        self._poke()

    async def _layer_dropped(self, data: bytes, _subject: str) -> None:
        """A snapshot was deleted: its layer's file goes from this node's cache (once no sandbox uses it)."""
        if self.layers.drop(data.decode(errors="replace")):
            log.info("dropped the layer of a deleted snapshot from the cache")

    def _poke(self) -> None:
        for w in (self._create_worker, self._pool_worker):
            if w is not None:
                w.poke()

    async def destroy(self, sandbox_id: str, state: str = "destroyed", reason: str = "") -> None:
        """Destroy a sandbox this edge runs and record why (KeyError if it does not run here)."""
        await self.box.destroy(sandbox_id, state, reason)

    async def stop(self) -> None:
        """Stop taking work, destroy every sandbox, release the node, hand waiting creates back.

        Order matters under the caller's budget (about 6 s): the node is marked draining (no new
        bookings) and the lanes stop within STOP_BUS_BUDGET; the backend's clean-up comes next, whatever
        happened before; records (through the outbox: what the bus does not take now is applied at the
        next start), bus bookkeeping and the hand-back come last, each bounded."""
        claims = dict(self.creates.claims)   # creates cut short below: their ids are freed at the end
        loop = asyncio.get_running_loop()
        until = loop.time() + STOP_BUS_BUDGET

        async def step(aw) -> None:
            try:
                await asyncio.wait_for(aw, max(0.05, until - loop.time()))
            except asyncio.CancelledError:
                raise
            except Exception as exc:   # whatever the bus does, the stop goes on
                log.info("stop step skipped: %s", exc)

        await self.fence.stop()
        try:
            await step(set_flag(self.bus, self.node, draining=True, stopping=True))
            for w in (self._create_worker, self._pool_worker):
                if w:
                    await step(w.stop(drain=False))
            await step(self.record.stop())
            await step(self.warm.stop())
            if self._dropped is not None:
                await step(self._dropped.unsubscribe())
            await step(self.ops.stop())
            if self.calls is not None:
                await step(self.calls.stop())
            for t in [*self._tasks, *self._expiring]:
                t.cancel()
            await step(asyncio.gather(*self._tasks, *self._expiring, return_exceptions=True))
        finally:
            try:
                await self.backend.stop()
            except BackendError as exc:
                log.error("backend stop incomplete: %s", exc)
            finally:
                await self.network.stop()
                await self.layers.stop()
        for sid in list(self.sandboxes):
            await self._best_effort(self.box.gone_now(sid, "destroyed", "edge stopped", wait=False))
        await self.outbox.close(drain=OUTBOX_DRAIN)
        await self._best_effort(self.bus.kv_delete(streams.NODES_KV, self.node))
        await self._best_effort(self._hand_back(claims), HAND_BACK_BUDGET)

    async def _hand_back(self, claims: dict[str, str]) -> None:
        """At a stop, after the node record is gone (nothing books it any more): free the ids of creates
        cut short, and send the creates waiting on this node's lane back to placement."""
        for sid, tenant in claims.items():
            await self.records.free_claim(tenant, sid)
        handed = await replace_creates(self.bus, self.node)
        if handed:
            log.warning("node %s stopping: %d waiting creates handed back to placement", self.node, handed)

    async def _best_effort(self, coro, budget: float = BUS_CLEANUP_TIMEOUT) -> None:
        try:
            await asyncio.wait_for(coro, budget)
        except asyncio.CancelledError:
            raise
        except Exception as exc:   # whatever the bus does, the stop goes on
            log.info("bus update skipped during cleanup: %s", exc)

    # ---- accounting and TTLs ------------------------------------------------------------------

    def _create_credit(self) -> int:
        """Create messages this edge may hold: free slots, plus those in flight that already booked one.
        A draining node still takes what its lane holds: placement booked those before the drain. None
        while the outbox is full (the bus has not taken what it holds for long)."""
        if self.outbox.full():
            return 0
        return self.capacity.free_slots() + sum(1 for i in self.creates.creating if i in self.capacity.used)

    def _pool_credit(self) -> int:
        """The pool's shared lane: nothing while draining."""
        return 0 if self.draining else self._create_credit()

    async def _ttl_loop(self) -> None:
        expiring = self._expiring
        in_flight: set[str] = set()       # ids whose _expire runs now
        pruned = refreshed = time.monotonic()
        while True:   # a look every TTL_EVERY, sooner when a deadline falls before it (an expiry is on time)
            await asyncio.sleep(min(TTL_EVERY, max(0.005, self.box.deadlines.next_at() - time.time())))
            if self.fence.tick():   # it did not run for FENCE_AFTER: its sandboxes were ended under it
                self._declared_lost("its edge did not run for %.0f s: the fence ended them" % FENCE_AFTER)
            if time.monotonic() - pruned >= MEMORY_PRUNE_EVERY and self.box.backend.memories():
                pruned = time.monotonic()
                task = asyncio.ensure_future(self._prune_memories())
                expiring.add(task)
                task.add_done_callback(expiring.discard)
            if time.monotonic() - refreshed >= REFRESH_EVERY:
                refreshed = time.monotonic()
                task = asyncio.ensure_future(self._refresh_records())
                expiring.add(task)
                task.add_done_callback(expiring.discard)
            now, max_paused = time.time(), self.config.max_paused
            for sid in self.box.deadlines.due(now, lambda sid: self.box.deadline(sid, max_paused)):
                self.box.deadlines.look(sid, now + TTL_EVERY)   # again then: an attempt that failed is retried
                if sid in in_flight:
                    continue
                in_flight.add(sid)
                task = asyncio.ensure_future(self._expire(sid))   # at once: one slow record holds no other
                expiring.add(task)
                task.add_done_callback(expiring.discard)
                task.add_done_callback(lambda _, sid=sid: in_flight.discard(sid))

    async def _refresh_records(self) -> None:
        try:
            age = await self.bus.kv_max_age(streams.SANDBOXES_KV)
            if age > 0 and await self.box.refresh(time.time() - REFRESH_AT * age, REFRESH_MAX):
                log.debug("records of sandboxes unchanged for %.0f s written again", REFRESH_AT * age)
        except Exception as exc:   # a sick bus: looked at again next time
            log.warning("records not refreshed: %s", exc)

    async def _prune_memories(self) -> None:
        try:
            await self.box.prune_memories()
        except Exception as exc:   # a sick bus: looked at again next time
            log.warning("memory snapshots not pruned: %s", exc)

    async def _expire(self, sandbox_id: str) -> None:
        try:
            running = self.sandboxes.get(sandbox_id)
            if running is not None and running.suspended_since:   # kept frozen past --max-paused
                await self.box.destroy(sandbox_id, state="expired",
                                       reason=f"suspended longer than --max-paused ({_span(self.config.max_paused)})")
                return
            if running is not None and running.record.on_timeout == "suspend":   # kept, frozen: resume goes on
                await self.box.suspend(sandbox_id)
                return
            await self.box.destroy(sandbox_id, state="expired", reason="ttl reached")
        except KeyError:
            pass    # destroyed by a request meanwhile
        except Exception:   # never let one failure end TTL enforcement for the node
            log.exception("ttl destroy of %s failed", sandbox_id)


def _span(seconds: float) -> str:
    """24 h, 90 min, 2 s."""
    for unit, size in (("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:g} {unit}"
    return f"{seconds:g} s"
