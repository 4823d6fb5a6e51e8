"""Container sandboxes: pid/mnt/net/uts/ipc namespaces, cgroup v1 limits, overlayfs over EROFS layers.

Lifecycle: start() reconciles what a crashed run of this node left (processes, cgroups, mounts,
writable layers, uid leases), then formats the writable-layer pool and starts the zygote (see
zygote.py), which forks every sandbox init (catatonit -P); commands are started by dsec-enter (see
enter.py). Each sandbox's root is a host uid range of its own (idmap.py). Work: create/exec/files/
destroy. A sandbox costs the host its catatonit (~50 KiB), its namespaces and mounts; no Python process.
"""
from __future__ import annotations

import asyncio
import collections
from pathlib import Path

from edge.backends import enter, idmap, procviews
from edge.backends.base import Backend, BackendError
from edge.backends.cgroups import NodeCgroups
from edge.backends.container.execs import Executing
from edge.backends.container.files import Files
from edge.backends.container.freezing import Freezing
from edge.backends.container.launch import Launching
from edge.backends.container.lifecycle import Lifecycle, leftovers
from edge.backends.container.reset import Resetting
from edge.backends.container.state import ID_RE, Running
from edge.backends.layermounts import LayerMounts
from edge.backends.launcher import Launcher
from edge.backends.uppers import UpperPool

__all__ = ["ContainerBackend", "leftovers"]


class ContainerBackend(Lifecycle, Launching, Executing, Files, Freezing, Resetting, Backend):
    """Sandboxes made directly of namespaces, cgroups and mounts (crun refuses hybrid cgroups here)."""

    kind = "container"

    def __init__(self, state_dir: Path, node_id: str, *, upper_pool_size: int = 64 << 30,
                 init_binary: str = "/usr/bin/catatonit") -> None:
        if not ID_RE.match(node_id):
            raise BackendError(f"invalid node id: {node_id!r}")
        self.state_dir = Path(state_dir).resolve()
        if any(c in str(self.state_dir) for c in ",:= "):
            raise BackendError(f"state dir must not contain , : = or space (overlay options): {self.state_dir}")
        self.node_id = node_id
        self._cgroups = NodeCgroups(node_id)
        self._uppers = UpperPool(self.state_dir, upper_pool_size)
        self._layers = LayerMounts(self.state_dir / "layers")
        self._empty = self.state_dir / "empty"     # the lowerdir of a sandbox without layers
        self._trusted = self.state_dir / "trusted"  # the trusted shell, bind-mounted at /.dsec in every sandbox
        self._packing = self.state_dir / "packing"  # snapshot packs' read-only idmapped views of uppers (packing.py)
        self._devices = self.state_dir / "devices"  # bound at /dev and /sys in every sandbox (nodemounts.py)
        self._sysfs = self.state_dir / "sysfs"
        self._launcher = Launcher(init_binary, label=f"{self.state_dir}:{node_id}")
        self._sandboxes: dict[str, Running] = {}
        self._keys: collections.OrderedDict[str, str] = collections.OrderedDict()   # claimed id -> key
        self._starting: set[str] = set()
        self._spawner: enter.Spawner | None = None   # exec spawns (dsec-enter, built at start)
        self._ids = idmap.Allocator(node_id)
        self._views = procviews.ProcViews(self.state_dir, self._refresh_views, serving=lambda: self._launcher.alive,
                                          node_id=node_id)
        self._io_device = ""                          # the pool's loop device: sandboxes' I/O is throttled on it
        self._drains: set[asyncio.Task] = set()       # ranges looked at again while their keys are collected
