"""A node's capacity and what its sandboxes use: the edge's own accounting (heartbeat source)."""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

import msgspec
import psutil

from bus import kinds, validate
from bus.messages import Resources
from bus.records import NodeInfo


DEFAULT_PYPI = "https://pypi.org/simple/"
DEFAULT_DEBIAN = "http://deb.debian.org/debian"
SLOT_MEMORY = 1 << 20     # the host memory a slot stands for by default (an idle sandbox costs less: bench.density)
PIDS_PER_SLOT = 2         # an idle sandbox's init, and one command


def default_slots(memory: int = 0) -> tuple[int, str]:
    """A node's default slot count and what capped it: its memory / SLOT_MEMORY, the uid ranges sandboxes
    lease (edge/backends/idmap.py), and the tasks its sandboxes may hold (hosttables.node_tasks) /
    PIDS_PER_SLOT."""
    from edge.backends import hosttables, idmap
    caps = {"memory": (memory or psutil.virtual_memory().total) // SLOT_MEMORY, "uid ranges": idmap.COUNT,
            "pids": hosttables.node_tasks(lifted=True) // PIDS_PER_SLOT}
    which = min(caps, key=lambda k: caps[k])
    return max(1, caps[which]), which


class EdgeConfig(msgspec.Struct, forbid_unknown_fields=True):
    """How an edge sizes itself. Fields left at 0 are derived from the machine with psutil."""

    node_id: str = "local"
    pool: str = "local"
    slots: int = 0                    # max sandboxes at once, all kinds together (0: default_slots())
    backends: list[str] = msgspec.field(default_factory=lambda: ["container"])   # the kinds it runs
    kind_slots: dict[str, int] = {}   # kind -> max sandboxes of it at once (unset: Capacity.kind_slots)
    cpu_overcommit: float = 16.0      # schedulable cores = physical cores x this
    memory_fraction: float = 0.8      # schedulable memory = RAM x this (no overcommit)
    disk: int = 64 << 30              # writable-layer pool size (sparse btrfs image)
    max_execs: int = 256              # concurrent execs across the node (>= 64)
    max_output: int = 64 << 20        # per-exec output cap, whatever a client asks for
    traj_output: int = 64 << 10       # bytes of each stream kept in an exec's trajectory record
    layer_cache: int = 16 << 30       # bytes of layers kept on the node (LRU beyond, never one in use)
    warm_max: int = 32                # warm-pool sandboxes kept ready on the node, all pools together
    max_paused: float = 24 * 3600.0   # seconds a suspended sandbox is kept, then destroyed as expired
    heartbeat: float = 2.0            # seconds between inventory updates
    cpus: float = 0.0                 # 0: psutil.cpu_count()
    memory: int = 0                   # 0: psutil total RAM
    aether: bool = True               # run the node's Aether (sandbox networks, aether/): off, every network
                                      # but none is refused here
    aether_dns: str = ""              # the resolver Aether asks for allowed names (ip[:port]; '': the host's)
    aether_allow_cidr: list[str] = []   # private ranges the operator lets sandboxes reach (tenants cannot)
    mirrors: bool = True              # run the node's package mirrors (aether/mirrors.py) with Aether
    mirror_pypi: str = DEFAULT_PYPI   # the index the pip mirror caches
    mirror_apt: str = DEFAULT_DEBIAN  # the Debian mirror the apt mirror caches
    lazy_layers: bool = False         # serve a layer not held yet from its chunks as they are read (lazylayers.py)
    lazy_fill: bool = True            # ...and fetch the rest behind the reads, until it is whole


@dataclass
class Capacity:
    """Totals and current usage; reserve() and release() keep usage exact."""

    config: EdgeConfig
    cores: float = 0.0
    cpu: float = 0.0
    memory: int = 0
    used: dict[str, Resources] = field(default_factory=dict)
    kind_of: dict[str, str] = field(default_factory=dict)
    per_kind: collections.Counter = field(default_factory=collections.Counter)
    accel: dict[str, str] = field(default_factory=dict)    # VM kind -> accelerator (set once backends started)

    def __post_init__(self) -> None:
        c = self.config
        self.cores = c.cpus or float(psutil.cpu_count() or 1)
        self.cpu = self.cores * c.cpu_overcommit
        self.memory = int((c.memory or psutil.virtual_memory().total) * c.memory_fraction)
        self._cpu, self._memory, self._disk = 0.0, 0, 0   # running sums: the record is rebuilt often

    def used_cpu(self) -> float:
        """Cores booked."""
        return max(0.0, self._cpu)

    def used_memory(self) -> int:
        """Bytes booked."""
        return self._memory

    def used_disk(self) -> int:
        """Writable-layer bytes booked."""
        return self._disk

    def free_slots(self) -> int:
        """Sandboxes that may still start."""
        return max(0, self.config.slots - len(self.used))

    def kind_slots(self, kind: str) -> int:
        """Sandboxes of this kind the node may hold (0: it does not run the kind): the operator's
        (--capacity KIND.slots=N), else for a VM kind as many of its smallest VMs (its least memory and
        its QEMU's overhead) as the node's memory holds, else `slots`."""
        c = self.config
        if kind not in c.backends:
            return 0
        default = c.slots
        if kind in kinds.MIN_MEMORY:
            default = min(default, max(1, self.memory // (kinds.MIN_MEMORY[kind] + kinds.OVERHEAD[kind][0])))
        return min(c.slots, c.kind_slots.get(kind, default))

    def free_kind_slots(self, kind: str) -> int:
        """Sandboxes of this kind that may still start."""
        return max(0, min(self.free_slots(), self.kind_slots(kind) - self.per_kind[kind]))

    def could_ever_fit(self, r: Resources, kind: str = "container") -> bool:
        """Whether r (with its kind's overhead) fits this node when it is empty."""
        r = kinds.booked(kind, r)
        return (self.kind_slots(kind) > 0 and r.cpu <= min(self.cores, self.cpu) and r.memory <= self.memory
                and r.disk <= self.config.disk)

    def fits(self, r: Resources, kind: str = "container") -> bool:
        """Whether r (with its kind's overhead) fits now on every dimension."""
        r = kinds.booked(kind, r)
        return (self.free_kind_slots(kind) > 0 and self.used_cpu() + r.cpu <= self.cpu + 1e-9
                and self.used_memory() + r.memory <= self.memory and self.used_disk() + r.disk <= self.config.disk)

    def reserve(self, sandbox_id: str, r: Resources, kind: str = "container") -> None:
        """Book r (with its kind's overhead) for a sandbox."""
        self.release(sandbox_id)
        r = kinds.booked(kind, r)
        self.used[sandbox_id] = r
        self.kind_of[sandbox_id] = kind
        self.per_kind[kind] += 1
        self._cpu += r.cpu
        self._memory += r.memory
        self._disk += r.disk

    def release(self, sandbox_id: str) -> None:
        """Free a sandbox's booking."""
        r = self.used.pop(sandbox_id, None)
        if r is not None:
            kind = self.kind_of.pop(sandbox_id, "container")
            self.per_kind[kind] -= 1
            if self.per_kind[kind] <= 0:
                del self.per_kind[kind]
            self._cpu -= r.cpu
            self._memory -= r.memory
            self._disk -= r.disk
            if not self.used:   # no float drift survives an empty node
                self._cpu, self._memory, self._disk = 0.0, 0, 0

    def node_info(self, draining: bool = False) -> NodeInfo:
        """The heartbeat record."""
        c = self.config
        return NodeInfo(node=c.node_id, pool=c.pool, slots=c.slots, cpu=self.cpu, memory=self.memory, disk=c.disk,
                        used_slots=len(self.used), used_cpu=self.used_cpu(), used_memory=self.used_memory(),
                        used_disk=self.used_disk(), max_cpu=self.cores, max_memory=self.memory,
                        max_disk=c.disk, max_pids=validate.MAX_PIDS, draining=draining, heartbeat=time.time(),
                        backends=list(c.backends), kind_slots={k: self.kind_slots(k) for k in c.backends},
                        kind_used=dict(self.per_kind), accel=dict(self.accel))
