"""One microVM as the backend holds it, and the constants its parts share."""
from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from edge.backends import idmap
from edge.backends.base import SandboxSpec
from edge.backends.gvisor.agent import AgentChannel
from edge.backends.microvm.qmp import Qmp

READY_TIMEOUT = float(os.environ.get("DSEC_VM_READY_TIMEOUT", "90"))   # a cold boot under TCG on a busy node
IGNORE_SHARED = [{"capability": "x-ignore-shared", "state": True}]   # a template's RAM stays out of its state
HOST_TASKS = 512            # QEMU's threads: a backstop only, the guest's pids limit is the guest's own


@dataclass
class VM:
    """A VM: its spec, QEMU process, agent channel and monitor, and how long it was frozen."""

    spec: SandboxSpec
    ids: idmap.IdRange
    key: str = ""               # names its dir, cgroups, uid lease and QEMU's -name: its first id (a warm one's)
    proc: asyncio.subprocess.Process | None = None
    chan: AgentChannel | None = None
    qmp: Qmp | None = None
    dying: asyncio.Future | None = None
    frozen_since: float | None = None
    frozen_total: float = 0.0
    packing: asyncio.Lock = field(default_factory=asyncio.Lock)   # one snapshot at a time (one freeze)
    watch: asyncio.Future | None = None                            # QEMU's exit, once it runs as a sandbox
    hide: list[Path] = field(default_factory=list)                 # more dirs QEMU must not see (its layers')
    end: object | None = None                                      # its network end (aether/), if it has one
    tap: int | None = None                                         # the edge's fd of its tap, until QEMU has it

    def __post_init__(self) -> None:
        self.key = self.key or self.spec.id

    def frozen_for(self) -> float:
        return self.frozen_total + (time.monotonic() - self.frozen_since if self.frozen_since is not None else 0.0)
