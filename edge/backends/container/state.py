"""What the container backend keeps per sandbox, its constants, and the look-ups every part of it uses."""
from __future__ import annotations

import asyncio
import collections
import itertools
import os
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from edge.backends import cgroups, enter, idmap
from edge.backends.base import BackendError, SandboxGone, SandboxSpec

ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
DEFAULT_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root"}
LAUNCH_TIMEOUT = 30.0
REAP_TIMEOUT = 10.0
RELEASE_RETRIES = (0.001, 0.004, 0.02, 0.1, 0.5)   # seconds between looks at a draining range
KEYS_KEPT = 4096            # claimed warm sandboxes whose cgroup/layer names residue() can still tell


@dataclass
class Running:
    """What the backend keeps about one running sandbox."""

    spec: SandboxSpec
    init_pid: int
    init_exit: asyncio.Future
    layers: list[Path]
    ids: idmap.IdRange
    pidfd: int = -1             # pins the init: /proc/<pid> opens are checked against it (pid reuse)
    execs: itertools.count = field(default_factory=lambda: itertools.count(1))
    events: Counter = field(default_factory=Counter)    # limit events of removed exec groups
    dying: asyncio.Future | None = None
    frozen_since: float | None = None   # monotonic time of the freeze (suspended), else None
    frozen_total: float = 0.0           # seconds spent frozen before that
    key: str = ""                       # names its cgroups and writable layer: its first id (a warm
                                        # sandbox keeps its pool name when a create claims it)
    call_group: cgroups.CallGroup | None = None   # a worker's one exec group (its x0), made at its first call
    call_tasks: list | None = None      # the tasks files its commands join
    resident: enter.Resident | None = None   # a worker's own exec server (started at its first call)
    scratch_fds: list | None = None     # a worker's scratch dirs, opened in its root at its first wipe

    def __post_init__(self) -> None:
        self.key = self.key or self.spec.id

    def close_files(self) -> None:
        """Close what a worker holds open for its calls (at its destroy)."""
        if self.call_group is not None:
            self.call_group.close()
        for _, fd in self.scratch_fds or ():
            os.close(fd)
        self.scratch_fds = None

    def frozen_for(self) -> float:
        """Seconds this sandbox has spent frozen so far (exec timeouts do not count them)."""
        return self.frozen_total + (time.monotonic() - self.frozen_since if self.frozen_since is not None else 0.0)


class Core:
    """The state every part of the backend shares (set up by ContainerBackend.__init__)."""

    _sandboxes: dict[str, Running]
    _keys: collections.OrderedDict[str, str]

    def _key(self, sandbox_id: str) -> str:
        """What names a sandbox's cgroups and writable layer (its id, unless it was a warm one)."""
        sb = self._sandboxes.get(sandbox_id)
        return sb.key if sb is not None else self._keys.get(sandbox_id, sandbox_id)

    def _live(self, sandbox_id: str) -> Running:
        sb = self._sandboxes.get(sandbox_id)
        if sb is None or sb.dying is not None:
            raise SandboxGone(f"no such sandbox: {sandbox_id}")
        if not self._launcher.alive:
            raise BackendError(f"container backend unavailable: {self._launcher.death}")
        if sb.init_exit.done():
            raise BackendError(f"sandbox {sandbox_id} is not running (its init exited); destroy it")
        return sb
