"""Node choice: a node must fit the request on every dimension; prefer the one with the most headroom."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from bus import streams
from bus.messages import NodeInfo, Resources


@dataclass
class NodeView:
    """Placement's view of one node: its last heartbeat plus what this engine placed since."""

    info: NodeInfo
    placed_since: list[Resources] = field(default_factory=list)

    def fresh(self, now: float) -> bool:
        """Heartbeat recent enough to trust."""
        return now - self.info.heartbeat < streams.NODE_HEARTBEAT_TTL

    def can_ever_fit(self, r: Resources) -> bool:
        """Whether the node could hold the request when empty (its per-request maximums)."""
        i = self.info
        return r.cpu <= i.max_cpu and r.memory <= i.max_memory and r.disk <= i.max_disk and r.pids <= i.max_pids

    def headroom(self) -> float:
        """Free share on the tightest dimension, counting this engine's placements since the heartbeat."""
        i = self.info
        slots = i.used_slots + len(self.placed_since)
        mem = i.used_memory + sum(p.memory for p in self.placed_since)
        cpu = i.used_cpu + sum(p.cpu for p in self.placed_since)
        shares = [1 - slots / max(i.slots, 1), 1 - mem / max(i.memory, 1), 1 - cpu / max(i.cpu, 1e-9)]
        return min(shares)


def pick(nodes: dict[str, NodeView], r: Resources, pool: str = "local") -> tuple[str | None, bool]:
    """(node with the most headroom that can fit r, whether any node could ever fit r)."""
    now = time.time()
    candidates = [n for n in nodes.values()
                  if n.info.pool == pool and n.fresh(now) and not n.info.draining and n.can_ever_fit(r)]
    if not candidates:
        any_alive = any(n.fresh(now) for n in nodes.values())
        return None, not any_alive   # no live node at all: wait; live nodes but too big: never
    best = max(candidates, key=lambda n: n.headroom())
    best.placed_since.append(r)
    return best.info.node, True
