"""Files of container sandboxes, resolved inside their root (rootfiles.py), and the checks tests read."""
from __future__ import annotations

import asyncio
import os
from collections import Counter
from pathlib import Path

from bus.messages import FileOp
from edge.backends import cgroups, rootfiles, watcher
from edge.backends.base import BackendError, ExecControl, ExecResult, OutputSink
from edge.backends.cgroups import NodeCgroups
from edge.backends.container.state import Core


class Files(Core):
    """write_file / read_file / file_op, limit events, cgroup paths."""

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None:
        """Create or truncate a file in the sandbox root filesystem (symlinks resolved inside it)."""
        sb = self._live(sandbox_id)
        pidfd = os.dup(sb.pidfd)   # our own copy: destroy may close the sandbox's while the thread runs
        await asyncio.to_thread(rootfiles.write, sandbox_id, sb.init_pid, pidfd, path, data, mode, sb.ids.base,
                                bool(sb.spec.scratch))

    async def read_file(self, sandbox_id: str, path: str, limit: int) -> bytes:
        """Read a file of the sandbox root filesystem, at most limit bytes (else BackendError)."""
        sb = self._live(sandbox_id)
        pidfd = os.dup(sb.pidfd)   # our own copy: destroy may close the sandbox's while the thread runs
        return await asyncio.to_thread(rootfiles.read, sandbox_id, sb.init_pid, pidfd, path, limit,
                                       bool(sb.spec.scratch))

    async def file_op(self, sandbox_id: str, op: FileOp, user=None) -> bytes:
        """One file-tree op in the sandbox root (rootfiles.tree_op) as user (a users.ExecUser; None: its
        root); its encoded FileOpResult."""
        sb = self._live(sandbox_id)
        base = sb.ids.base
        who = None if user is None else user.on_host(base)
        pidfd = os.dup(sb.pidfd)   # our own copy: destroy may close the sandbox's while the thread runs
        return await asyncio.to_thread(rootfiles.tree_op, sandbox_id, sb.init_pid, pidfd, op, base,
                                       bool(sb.spec.scratch), who)

    async def watch(self, sandbox_id: str, path: str, recursive: bool, *, timeout: float, sink: OutputSink,
                    control: ExecControl | None = None) -> ExecResult:
        """A directory's changes (watcher.py), resolved inside the sandbox's root each time a directory is added."""
        sb = self._live(sandbox_id)
        if sb.spec.scratch:
            raise BackendError("a worker's directories cannot be watched")

        def opener(p: str) -> int:
            return rootfiles.open_dir(sandbox_id, sb.init_pid, os.dup(sb.pidfd), p)
        return await watcher.watch(opener, path, recursive, timeout, sink, control, sb.frozen_for,
                                   owner=sb.ids.base)

    def cgroup_dir(self, sandbox_id: str, controller: str) -> Path:
        """The sandbox's group directory in one controller (tests read limit events there)."""
        return self._cgroups.sandbox(self._key(sandbox_id))[controller]

    def limit_events(self, sandbox_id: str) -> dict[str, int]:
        """How often each limit fired in a sandbox so far: pids_max, oom_kill, memory/memsw failcnt."""
        return self._limit_events(self._live(sandbox_id))

    def _limit_events(self, sb) -> dict[str, int]:
        total = Counter(sb.events)   # (of its exec groups gone already)
        top = self._cgroups.sandbox(sb.key)
        total.update(NodeCgroups.limit_events(top))
        for child in top["pids"].glob("x*"):
            total.update(NodeCgroups.limit_events({c: p / child.name for c, p in top.items()
                                                   if c in cgroups.EXEC_CONTROLLERS}))
        return dict(total)

    def init_pid(self, sandbox_id: str) -> int:
        """Host pid of the sandbox's init."""
        return self._live(sandbox_id).init_pid
