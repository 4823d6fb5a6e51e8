"""Warm pools: sandboxes an edge starts before anyone asks for them, for the (layers, resources) keys
configured in KV dsec-warm-pools. A create whose layers and resources match takes one: the backend
gives it the create's id, hostname and env (Backend.claim), so it is what a cold start would have
made. Each warm sandbox is used once; the pool refills in the background.

Sizing: a pool holds what its recent demand asks for — the creates that matched it over the last
WINDOW seconds, as a rate, times HORIZON seconds — never below `min` nor above `max`. Extras beyond
that are destroyed once they sat unclaimed for IDLE seconds. Warm sandboxes book no capacity (an idle
catatonit, an overlay, empty cgroups): the node's booked usage is the truth placement sees, and a
pool fills only while the node has room for its sandboxes to be claimed.

Layer names are resolved again every RESOLVE_EVERY seconds: after `dsec image build` makes a new
version, creates ask for the new digests, the pool turns over to them and the old warm sandboxes go.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Callable

import msgspec

from bus import streams, subjects
from bus.conn import Bus, kv_watch
from bus.errors import DsecError, ImageNotFound, InvalidRequest
from bus.messages import LayerRef, Resources
from bus.records import WarmPool, pool_key, warm_pool_decoder, warm_pool_key
from bus.images import ImageRegistry
from edge.backends.base import Backend, BackendError, Limits, SandboxGone, SandboxSpec
from edge.capacity import Capacity
from edge.layercache import LayerCache

log = logging.getLogger(__name__)

WINDOW = 10.0           # seconds of matching creates the demand rate is taken over
HORIZON = 2.0           # a pool holds what that rate asks for in this many seconds (within min..max)
TICK = 1.0              # seconds between two looks at every pool when nothing wakes the loop
RESOLVE_EVERY = 2.0     # seconds a pool's resolved layers are trusted
IDLE = 10.0             # a warm sandbox beyond its pool's target goes after this long unclaimed
YIELD_FOR = 0.05        # a refill waits up to this long for the creates in flight to be answered
PAUSE = 5.0             # after a failed start, a pool waits this long before it tries again


def limits(r: Resources, cpu_class: str = "latency") -> Limits:
    """The backend limits of a create's resources."""
    return Limits(cpu=r.cpu, memory=r.memory, pids=r.pids, disk=r.disk, cpu_class=cpu_class)


@dataclass
class Stock:
    """One pool on this edge: its settings, resolved layers and ready sandboxes."""

    spec: WarmPool
    layers: list[LayerRef] = field(default_factory=list)
    key: str = ""                 # pool_key of the resolved layers; "" until resolved
    resolved_at: float = -1e9
    ready: collections.deque = field(default_factory=collections.deque)    # (warm id, started), oldest first
    demand: collections.deque = field(default_factory=collections.deque)   # when matching creates came
    paused_until: float = 0.0
    error: str = ""               # why it is not filling, if it is not

    def target(self, now: float) -> int:
        """How many ready sandboxes it should hold now."""
        while self.demand and now - self.demand[0] > WINDOW:
            self.demand.popleft()
        want = math.ceil(len(self.demand) / WINDOW * HORIZON)
        return max(self.spec.min, min(self.spec.max, want))


def _owner(stock: Stock) -> str:
    """The tenant a pool's stock counts against (a project's: its tenant's)."""
    return subjects.tenant_root(stock.spec.owner or "default")


class WarmPools:
    """The warm pools of one edge."""

    def __init__(self, bus: Bus, node: str, *, pool: str, warm_max: int, capacity: Capacity, layers: LayerCache,
                 backend: Backend, changed: Callable[[], None], busy: Callable[[], bool],
                 draining: Callable[[], bool]) -> None:
        self.bus, self.node, self.pool, self.warm_max = bus, node, pool, warm_max
        self.capacity, self.layers, self.backend = capacity, layers, backend
        self.changed = changed      # the node record's warm stock changed
        self.busy = busy            # creates are being served now (a refill waits for them)
        self.draining = draining    # the node takes no new creates
        self.pools: dict[str, Stock] = {}
        self._by_key: dict[str, Stock] = {}
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._retiring: set[asyncio.Task] = set()
        self._asked: collections.OrderedDict[str, None] = collections.OrderedDict()   # request ids counted
        self.filling = 0
        self.hits = 0           # creates that took a warm sandbox
        self.misses = 0         # creates that matched a pool with none ready
        self.started = 0        # warm sandboxes started
        self.failures = 0       # warm sandboxes that failed to start

    async def start(self) -> None:
        """Watch the pool settings and keep the pools filled."""
        self._tasks = [await kv_watch(self.bus, streams.WARM_POOLS_KV, self._on_change, on_synced=self._on_synced),
                       asyncio.create_task(self._loop())]

    async def stop(self) -> None:
        """Stop filling. Warm sandboxes being retired finish with the backend's stop, which destroys the
        rest with every other sandbox."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    # ---- what the edge asks -----------------------------------------------------------------------

    def take(self, layers: list[LayerRef], resources: Resources, request_id: str,
             kind: str = "container", tenant: str = "default") -> str | None:
        """A ready sandbox for a create of this kind with these layers and resources. The request's demand (and a
        miss) counts once, however often it asks (a redelivery, the short way then the usual one)."""
        if not self._by_key:   # no pool on this node: nothing to hash on the create path
            return None
        stock = self._by_key.get(pool_key(layers, resources, kind, tenant))   # only its own tenant's pools
        if stock is None:
            return None
        first = request_id not in self._asked
        if first:
            self._asked[request_id] = None
            while len(self._asked) > 4096:
                self._asked.popitem(last=False)
            stock.demand.append(time.monotonic())
            self._wake.set()
        if not stock.ready:
            self.misses += first
            return None
        self.hits += 1
        self.changed()
        return stock.ready.popleft()[0]

    def retire(self, warm_id: str) -> None:
        """Destroy a warm sandbox in the background."""
        task = asyncio.ensure_future(self._destroy(warm_id))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)
        self.changed()   # the node record's warm stock

    def died(self, warm_id: str, why: str) -> bool:
        """A warm sandbox ended by itself (its init died): out of stock now (no claim meets it) and destroyed,
        so the pool starts another. False when it is not a ready one of this edge's pools."""
        for stock in self.pools.values():
            for entry in stock.ready:
                if entry[0] == warm_id:
                    stock.ready.remove(entry)
                    log.warning("warm sandbox %s of pool %s ended by itself (%s): replaced", warm_id, stock.spec.name, why)
                    self.retire(warm_id)
                    self._wake.set()
                    return True
        return False

    def ready(self) -> int:
        """Warm sandboxes ready on this edge."""
        return sum(len(s.ready) for s in self.pools.values())

    def stock(self) -> dict[str, int]:
        """pool_key -> ready count (the node record's `warm`)."""
        return {s.key: len(s.ready) for s in self.pools.values() if s.key and s.ready}

    def digests(self) -> set[str]:
        """Layers the pools keep mounted (never evicted from the layer cache)."""
        return {la.digest for s in self.pools.values() for la in s.layers}

    # ---- settings ---------------------------------------------------------------------------------

    def _on_change(self, name: str, raw: bytes | None, revision: int) -> None:
        spec = None   # (name: the pool's key, <owner>.<name>)
        if raw is not None:
            with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                spec = warm_pool_decoder.decode(raw)
        old = self.pools.get(name)
        if spec is None or spec.node_pool != self.pool or warm_pool_key(spec.owner, spec.name) != name:
            if old is not None:
                self._drop(self.pools.pop(name))
        elif old is not None and _what(old.spec) == _what(spec):
            old.spec = spec    # new bounds: the ready ones stay, the target follows
        else:
            if old is not None:
                self._drop(old)
            self.pools[name] = Stock(spec)
        self._wake.set()

    def _on_synced(self, present: set[str]) -> None:
        """The bucket's whole content was read: a pool not in it was deleted while the watch was away (its
        delete marker swept since, so no update says it): drop it (it was kept and refilled for good)."""
        for name in [n for n in self.pools if n not in present]:
            self._drop(self.pools.pop(name))
        self._wake.set()

    def _drop(self, stock: Stock) -> None:
        self._empty(stock)
        stock.key = ""
        self._index()

    def _empty(self, stock: Stock) -> None:
        """Retire every ready sandbox of a pool."""
        while stock.ready:
            self.retire(stock.ready.popleft()[0])

    def _index(self) -> None:
        """Pools by key. Two pools of one key (same layers and resources) are one: the one serving it
        already (else the first by name) fills and is claimed, the other stays empty and says so."""
        before, self._by_key = self._by_key, {}
        for name in sorted(self.pools, key=lambda n: (before.get(self.pools[n].key) is not self.pools[n], n)):
            stock = self.pools[name]   # the one that served its key so far stays first: no churn
            if not stock.key:
                continue
            first = self._by_key.setdefault(stock.key, stock)
            if first is not stock:
                stock.error = f"same layers and resources as pool {first.spec.name}: that one is kept"
                self._empty(stock)

    # ---- filling ----------------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), TICK)
            self._wake.clear()
            for _ in range(int(YIELD_FOR / 0.002)):   # creates in flight go first: a start takes the loop
                if not self.busy():              # for a millisecond or two
                    break
                await asyncio.sleep(0.002)
            try:
                await self._tend()
            except asyncio.CancelledError:
                raise
            except Exception:   # never let one failure end the pools of the node
                log.exception("warm pools of %s", self.node)
                await asyncio.sleep(TICK)

    async def _tend(self) -> None:
        """Resolve what is due, trim what is idle beyond the target, start one sandbox where one is
        missing (then look again at once: pools fill in turn, one start at a time)."""
        now = time.monotonic()
        for stock in list(self.pools.values()):
            if now - stock.resolved_at > RESOLVE_EVERY:
                await self._resolve(stock)
        self._index()
        hungry, share = self._shares(now)   # (once a pass: each is a walk over every pool)
        for stock in list(self.pools.values()):
            if not stock.key or self._by_key.get(stock.key) is not stock:
                continue
            if self.draining():   # it takes no new creates: nothing will claim them
                self._empty(stock)
                continue
            target = stock.target(now)
            while len(stock.ready) > target and now - stock.ready[0][1] > IDLE:
                self.retire(stock.ready.popleft()[0])
            past = self._past_share(stock, hungry, share)
            if stock.ready and past > 0 and self.ready() + self.filling >= self.warm_max:   # another's waits for room
                self.retire(stock.ready.popleft()[0])
            if len(stock.ready) < target and now >= stock.paused_until and self._room(stock) and past < 0:
                await self._fill_one(stock)
                self._wake.set()

    async def _resolve(self, stock: Stock) -> None:
        spec = stock.spec
        try:
            layers = await ImageRegistry(self.bus).compose(spec.image, spec.workspace, spec.toolkit)
            key, stock.error = pool_key(layers, spec.resources, spec.backend, spec.owner or "default"), ""
        except (ImageNotFound, InvalidRequest) as exc:   # gone (or never was): nothing to keep warm
            layers, key, stock.error = [], "", str(exc)
        except DsecError as exc:   # the bus, for now: keep what it has, look again soon
            stock.error, stock.resolved_at = f"layers not resolved: {exc}", time.monotonic() - RESOLVE_EVERY + TICK
            return
        stock.resolved_at = time.monotonic()
        if key != stock.key:   # a new version of a layer (or none any more): the old warm ones go
            self._drop(stock)
            stock.layers, stock.key = layers, key

    def _shares(self, now: float) -> tuple[set[str], int]:
        """The tenants with a pool here below its target that could fill now (not one paused after failures,
        nor one whose sandboxes the node cannot hold: it would keep the others at their share for nothing), and
        the node's warm budget over the tenants whose pools want stock or hold it."""
        cap = self.capacity
        hungry = {_owner(s) for s in self.pools.values()
                  if s.key and len(s.ready) < s.target(now) and now >= s.paused_until
                  and cap.fits(s.spec.resources, s.spec.backend)}
        wanting = hungry | {_owner(s) for s in self.pools.values() if s.ready}
        return hungry, max(1, self.warm_max // max(1, len(wanting)))

    def _past_share(self, stock: Stock, hungry: set[str], share: int) -> int:
        """How far its tenant's warm stock is past its share while another tenant's pool waits (-1: not
        bound by it): one tenant's pool of min=max=32 held the node's whole budget, and another's never filled
        (helper A3). At 0 it fills no more; past it, it gives back one at a time once the budget is full."""
        me = _owner(stock)
        if not hungry - {me}:
            return -1
        return sum(len(s.ready) for s in self.pools.values() if _owner(s) == me) - share

    def _room(self, stock: Stock) -> bool:
        cap, held = self.capacity, self.ready() + self.filling
        kind = stock.spec.backend
        return (not self.draining() and held < self.warm_max and cap.free_kind_slots(kind) > held
                and cap.fits(stock.spec.resources, kind))

    async def _fill_one(self, stock: Stock) -> None:
        warm_id, key = f"warm-{secrets.token_hex(6)}", stock.key
        self.filling += 1
        try:
            paths = await self.layers.ensure(stock.layers)
            await self.backend.create(SandboxSpec(id=warm_id, layers=paths, limits=limits(stock.spec.resources),
                                                  kind=stock.spec.backend, warm=True))
        except (DsecError, BackendError, OSError) as exc:
            self.failures += 1
            stock.error, stock.paused_until = f"warm sandbox did not start: {exc}", time.monotonic() + PAUSE
            log.warning("pool %s on %s: %s", stock.spec.name, self.node, stock.error)
            return
        finally:
            self.filling -= 1
        self.started += 1
        current = self.pools.get(warm_pool_key(stock.spec.owner, stock.spec.name))
        if current is not stock or stock.key != key:   # changed meanwhile
            self.retire(warm_id)
            return
        stock.ready.append((warm_id, time.monotonic()))
        self.changed()

    async def _destroy(self, warm_id: str) -> None:
        try:
            await self.backend.destroy(warm_id)
        except SandboxGone:
            pass
        except BackendError as exc:
            log.error("warm sandbox %s not destroyed: %s", warm_id, exc)


def _what(spec: WarmPool) -> tuple:
    """What a pool's sandboxes are made of (its bounds aside)."""
    return spec.backend, spec.image, spec.workspace, spec.toolkit, spec.resources
