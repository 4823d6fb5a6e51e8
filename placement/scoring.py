"""Node choice: a node must fit the request on every dimension; among those that fit, the one the
request leaves least fragmented wins. At scale only k random candidates are looked at.

Each node's record carries its capacity (already multiplied by the edge's per-dimension overcommit:
CPU > 1 by default, memory none), its usage as the edge counts it, and the bookings placement made
that the edge has not taken yet. Free = capacity - usage - bookings, on every dimension.

Fragmentation: after placing r, a node keeps a normalised leftover per dimension. The score is the sum
of the leftovers plus half their spread (max - min): small leftovers pack nodes tightly (best fit, so big
requests still find an empty enough node), a small spread avoids nodes whose CPU is gone while memory
is left (or the reverse), which nothing could use. Lowest score wins.

Affinity: among nodes whose scores are close, one that already holds the request's layers (no fetch)
wins, and one with a warm sandbox for it (no start at all) wins over that. Both are small bonuses taken
off the score (LAYER_BONUS, WARM_BONUS), so they never override a clearly better fit; the edges list
the layers they hold and their warm stock in their node records.

Kinds: a node lists the backend kinds it runs with slots for each (kind_slots), within its slots in all;
a request of a kind fits only a node that runs that kind and has a slot of it free. The resources
placement books are the request's plus its kind's overhead (bus/kinds.py), from the node's one pool of
cpu, memory and disk, so a node full of containers has no room left for a VM.

Power of k choices: scanning every node costs O(nodes) per request and sends every engine to the same
best node, where their compare-and-set writes conflict. With more than SCAN_ALL nodes, K random fitting
candidates are drawn and the best of them is taken: packing stays close to a full scan (the fuller of
the sampled nodes still wins) while engines spread over different nodes (Mitzenmacher's "power of two
choices"). Measured with 8 nodes and 2 engines (bench/placement.py): scanning all 8 gave p99 71 ms at
300 creates/s, sampling 4 gave 30 ms; one engine went from 1,327 to 1,474 placements/s.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Callable

from bus import streams
from bus.messages import LayerRef, Resources
from bus.records import NodeInfo, layer_mark, pool_key

SCAN_ALL = 4      # up to this many live nodes, look at all of them
K = 4             # beyond, sample this many fitting candidates
SPREAD_WEIGHT = 0.5   # how much an unbalanced leftover counts against a tight one
LAYER_BONUS = 0.1     # the node holds every layer of the request
WARM_BONUS = 0.2      # the node has a warm sandbox for the request


@dataclass
class Free:
    """What a node has left on every dimension."""

    slots: int
    cpu: float
    memory: int
    disk: int


def free_of(i: NodeInfo) -> Free:
    """Capacity minus the edge's usage minus outstanding bookings."""
    b = i.bookings.values()
    return Free(slots=i.slots - i.used_slots - len(i.bookings),
                cpu=i.cpu - i.used_cpu - sum(x.resources.cpu for x in b),
                memory=i.memory - i.used_memory - sum(x.resources.memory for x in b),
                disk=i.disk - i.used_disk - sum(x.resources.disk for x in b))


def kind_slots(i: NodeInfo, kind: str) -> int:
    """Sandboxes of this kind the node may hold (0: it does not run the kind)."""
    if kind not in i.backends:
        return 0
    return min(i.slots, i.kind_slots.get(kind, i.slots))


def kind_free(i: NodeInfo, kind: str) -> int:
    """Slots of this kind left: its cap minus what runs minus what is booked."""
    booked = sum(1 for x in i.bookings.values() if x.kind == kind)
    return kind_slots(i, kind) - i.kind_used.get(kind, 0) - booked


def kinds_offered(nodes: list[NodeInfo]) -> list[str]:
    """Every kind some node of the list runs."""
    return sorted({k for i in nodes for k in i.backends if kind_slots(i, k) > 0})


def alive(i: NodeInfo, now: float) -> bool:
    """Heartbeat recent enough to place on (and not declared lost)."""
    return not i.lost and now - i.heartbeat < streams.NODE_LOST_AFTER


def can_ever_fit(i: NodeInfo, r: Resources, kind: str = "container") -> bool:
    """Whether the node could hold r of this kind when empty (its kinds, its per-request maximums)."""
    return (kind_slots(i, kind) > 0 and r.cpu <= i.max_cpu and r.cpu <= i.cpu and r.memory <= i.max_memory
            and r.disk <= i.max_disk and r.pids <= i.max_pids)


def fits(i: NodeInfo, r: Resources, f: Free | None = None, kind: str = "container") -> bool:
    """Whether r of this kind fits now on every dimension."""
    f = f or free_of(i)
    return f.slots >= 1 and kind_free(i, kind) >= 1 and r.cpu <= f.cpu + 1e-9 and r.memory <= f.memory and r.disk <= f.disk


def fragmentation(i: NodeInfo, r: Resources, f: Free | None = None) -> float:
    """Score of placing r on i (lower is better): normalised leftovers plus their spread."""
    f = f or free_of(i)
    left = [(f.slots - 1) / max(i.slots, 1), (f.cpu - r.cpu) / max(i.cpu, 1e-9),
            (f.memory - r.memory) / max(i.memory, 1), (f.disk - r.disk) / max(i.disk, 1)]
    return sum(left) + SPREAD_WEIGHT * (max(left) - min(left))


class Affinity:
    """How much placing a create with these layers and resources on a node saves: a warm sandbox ready
    for it (WARM_BONUS), or its layers already in the node's cache (LAYER_BONUS)."""

    def __init__(self, layers: list[LayerRef], r: Resources, kind: str = "container", tenant: str = "default") -> None:
        self.key = pool_key(layers, r, kind, tenant)
        self.marks = {layer_mark(la.digest) for la in layers}

    def warm(self, i: NodeInfo) -> bool:
        """Whether the node has a warm sandbox for it (a dict look-up: cheap enough to ask every node)."""
        return i.warm.get(self.key, 0) > 0

    def __call__(self, i: NodeInfo) -> float:
        if self.warm(i):
            return WARM_BONUS
        return LAYER_BONUS if self.marks and self.marks.issubset(i.layers) else 0.0


def affinity(layers: list[LayerRef], r: Resources, kind: str = "container", tenant: str = "default") -> Affinity:
    """The bonus function of a create (see Affinity)."""
    return Affinity(layers, r, kind, tenant)


def _no_bonus(i: NodeInfo) -> float:
    return 0.0


def placeable(i: NodeInfo, pool: str, now: float) -> bool:
    """A node placement may book: of the pool, alive, not draining."""
    return i.pool == pool and not i.draining and alive(i, now)


def choose(nodes: list[NodeInfo], r: Resources, *, pool: str = "local", exclude: frozenset[str] = frozenset(),
           k: int = K, rng: random.Random | None = None, now: float | None = None,
           prefer: Callable[[NodeInfo], float] = _no_bonus, kind: str = "container") -> tuple[str | None, bool]:
    """(best node for r of this kind, whether any live node of the pool could ever fit it); prefer(node) is
    a bonus taken off a node's score (see affinity). r includes the kind's overhead (kinds.booked)."""
    now = time.time() if now is None else now
    live = [i for i in nodes if placeable(i, pool, now) and i.node not in exclude]
    ever = any(can_ever_fit(i, r, kind) for i in live)

    def ok(i: NodeInfo) -> bool:
        return can_ever_fit(i, r, kind) and fits(i, r, kind=kind)

    if len(live) > SCAN_ALL:
        rng = rng or random
        # Random order: k fitting candidates, and when some node has a warm sandbox for the request,
        # until one such node is among them too (met in the same random order: engines still spread).
        warm = getattr(prefer, "warm", None)
        hunting = warm is not None and any(warm(i) and ok(i) for i in live)
        sample, found = [], 0
        for i in rng.sample(live, len(live)):
            if not ok(i):
                continue
            is_warm = hunting and warm(i)
            if len(sample) < k or is_warm:
                sample.append(i)
                found += is_warm
            if len(sample) >= k and (not hunting or found):
                break
        live = sample
    scored = [(fragmentation(i, r) - prefer(i), i.node) for i in live if ok(i)]
    if not scored:
        return None, ever
    return min(scored)[1], True


def utilization(nodes: list[NodeInfo], pool: str = "local", now: float | None = None) -> float:
    """Booked share of the pool's tightest dimension (slots, cpu, memory), over its live nodes."""
    now = time.time() if now is None else now
    live = [i for i in nodes if placeable(i, pool, now)]
    if not live:
        return 0.0
    cap = [sum(i.slots for i in live), sum(i.cpu for i in live), sum(i.memory for i in live)]
    free = [free_of(i) for i in live]
    left = [sum(f.slots for f in free), sum(f.cpu for f in free), sum(f.memory for f in free)]
    return max(1 - lf / c if c > 0 else 1.0 for lf, c in zip(left, cap))
