"""FnCall: stateless function calls served by pre-started workers (kind "fncall").

A worker is a sandbox of the container backend made for it (its own, under state_dir with node id
<node>.fn, so it shares nothing with the node's containers): the image's layers as a read-only root, a
tmpfs scratch at /tmp (the default cwd), no network, its limits. A call runs one command in a free
worker of its image and resources, then the worker is wiped (container/reset.py) and serves the next.

What a call finds, whatever calls ran before on the same worker (tests/backends/test_fncall.py):
  - files: the image's, read-only; /tmp and /dev/shm empty (mode 1777); the files given with the call;
  - processes: only the worker's init (everything a call started, background ones too, is killed);
  - environment: the image's defaults plus the call's env, nothing else (every command gets its own);
  - SysV IPC and POSIX message queues: none (each command has an IPC namespace of its own);
  - keyrings: its own (each command has a user namespace of its own);
  - memory: the worker's cgroup holds nothing of earlier calls (their processes are gone); limits as set.
What stays: the worker's hostname (its id), its kernel namespaces (pid, net with lo only, uts, cgroup),
its cgroups and limits, and its uid range (the same unprivileged host uids for every call).

Pool: per key (layers, limits) a stack of idle workers. A call takes one, or starts one while the pool
holds fewer than workers_max; else it waits for one to come back. Idle workers beyond workers_min per
key are retired after IDLE_RETIRE seconds; a worker whose wipe fails is retired at once.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from bus import kinds
from bus.validate import MAX_CALL_ANSWER, MAX_CALL_FILES as MAX_FILES_BYTES
from edge.backends.base import Backend, BackendError, CommandNotStarted, ExecResult, Limits, SandboxSpec
from edge.backends.rootfiles import FileError, FileTooLarge

log = logging.getLogger(__name__)

IDLE_RETIRE = 10.0     # seconds an idle worker beyond workers_min is kept


@dataclass
class CallSpec:
    """One call, as the edge hands it to the backend."""

    layers: list[str]                     # local EROFS files of the image, lowest first
    limits: Limits
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cwd: str = "/tmp"
    stdin: bytes = b""
    timeout: float = 10.0
    files: dict[str, bytes] = field(default_factory=dict)   # written before the command (under /tmp or /dev/shm)
    read_back: list[str] = field(default_factory=list)      # read after it
    max_output: int = 256 << 10                            # bytes kept per stream (the rest is counted, dropped)


@dataclass
class CallOutcome:
    """How a call ended, with its output and the files read back."""

    result: ExecResult
    stdout: bytes
    stderr: bytes
    truncated: bool
    files: dict[str, bytes]
    worker: str
    error: str = ""            # the command never started (not found...): exit_code -1
    unread: dict[str, str] = field(default_factory=dict)   # read_back paths not read back -> why


@dataclass
class _Pool:
    idle: list[tuple[str, float]] = field(default_factory=list)   # (worker id, idle since), last used on top
    busy: set[str] = field(default_factory=set)
    starting: int = 0


class FnCallBackend(Backend):
    """Calls on pooled workers; no sandboxes of its own to create."""

    kind = kinds.FNCALL

    def __init__(self, state_dir: Path, node_id: str, *, workers_min: int = 2, workers_max: int = 32,
                 scratch: int = 64 << 20) -> None:
        from edge.backends.container import ContainerBackend
        if not 0 <= workers_min <= workers_max or workers_max < 1:
            raise BackendError(f"fncall workers: need 0 <= min <= max and max >= 1, got {workers_min}/{workers_max}")
        self.workers_min, self.workers_max, self.scratch = workers_min, workers_max, scratch
        self.node_id = f"{node_id}.fn"
        self._workers = ContainerBackend(Path(state_dir), self.node_id, upper_pool_size=1 << 30)
        self._pools: dict[tuple, _Pool] = collections.defaultdict(_Pool)
        self._waiters: collections.deque[tuple[tuple, asyncio.Future]] = collections.deque()   # FIFO
        self._names = itertools.count(1)
        self._reaper: asyncio.Task | None = None
        self.on_free = lambda: None   # called when a worker comes free (the call lane pulls again)
        self.calls = 0
        self.started = 0

    # ---- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        await self._workers.start()
        self._reaper = asyncio.ensure_future(self._retire_idle())

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
        self._pools.clear()
        await self._workers.stop()

    def sandboxes(self) -> list[str]:
        return []   # workers are the node's, never a tenant's sandbox

    def workers(self) -> int:
        """Workers started now (idle, busy or starting)."""
        return sum(len(p.idle) + len(p.busy) + p.starting for p in self._pools.values())

    def free(self) -> int:
        """Calls it can take now without waiting (an idle worker, or room to start one)."""
        idle = sum(len(p.idle) for p in self._pools.values())
        return idle + max(0, self.workers_max - self.workers())

    def busy(self) -> bool:
        return any(p.busy or p.starting for p in self._pools.values())

    def leaks(self) -> list[str]:
        return self._workers.leaks()

    def leftovers(self) -> list[str]:
        return self._workers.leftovers()

    def residue(self, sandbox_id: str) -> list[str]:
        return self._workers.residue(sandbox_id)

    # ---- work ---------------------------------------------------------------------------------

    async def call(self, spec: CallSpec, on_worker=lambda: None) -> CallOutcome:
        """Run one call on a worker of its image and limits (started if none is free and there is room,
        else the first one freed); the worker is wiped before it serves again. on_worker: called once the
        call has its worker."""
        key = (tuple(spec.layers), spec.limits)
        worker = await self._take(key, spec)
        on_worker()
        try:
            return await self._run(worker, spec)
        finally:
            self.calls += 1
            # wiped a loop turn later: the caller's answer goes out first (its flush is scheduled then)
            asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(self._give_back(key, worker)))

    async def _take(self, key: tuple, spec: CallSpec) -> str:
        """A worker for key: an idle one, a new one while there is room, an idle one of another key
        retired for room, else the first one handed back (waiters are served in order, one each)."""
        pool = self._pools[key]
        while True:
            if pool.idle:
                worker, _ = pool.idle.pop()
                pool.busy.add(worker)
                return worker
            if self.workers() < self.workers_max:
                return await self._start_worker(key, pool, spec)
            if self._evict_idle(key):   # room held by an idle worker of another key: retired, start ours
                continue
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append((key, fut))
            try:
                handed = await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled() and fut.result():   # handed a worker as we left
                    asyncio.ensure_future(self._give_back(key, fut.result()))
                raise
            if handed:
                return handed

    def _hand_over(self, key: tuple, worker: str | None) -> bool:
        """A worker of key came free (or, None, room did): to the first waiter of key (True: taken), else
        wake the first waiter of any key to look again."""
        for i, (k, fut) in enumerate(self._waiters):
            if k == key and worker is not None and not fut.done():
                del self._waiters[i]
                fut.set_result(worker)
                return True
        while self._waiters:
            _, fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                break
        return False

    async def _start_worker(self, key: tuple, pool: _Pool, spec: CallSpec) -> str:
        worker = f"fn-{next(self._names)}"
        pool.starting += 1
        try:
            await self._workers.create(SandboxSpec(id=worker, layers=list(spec.layers), limits=spec.limits,
                                                   kind=kinds.CONTAINER, scratch=self.scratch))
        except BaseException:
            pool.starting -= 1
            self._hand_over(key, None)   # its room is free again
            raise
        pool.starting -= 1
        self.started += 1
        pool.busy.add(worker)
        return worker

    def _evict_idle(self, want: tuple) -> bool:
        """Retire the longest idle worker of another key; False when there is none."""
        oldest = min(((since, k, w) for k, p in self._pools.items() if k != want for w, since in p.idle),
                     default=None)
        if oldest is None:
            return False
        _, k, w = oldest
        self._pools[k].idle = [(x, s) for x, s in self._pools[k].idle if x != w]
        asyncio.ensure_future(self._retire(w))
        return True

    async def _run(self, worker: str, spec: CallSpec) -> CallOutcome:
        total = sum(len(d) for d in spec.files.values())
        if total > MAX_FILES_BYTES:
            raise BackendError(f"files: at most {MAX_FILES_BYTES} bytes with a call, got {total}")
        for path, data in spec.files.items():
            await self._workers.write_file(worker, path, data, 0o644)
        error = ""
        try:
            whole = await self._workers.collect(worker, spec.argv, env=spec.env, cwd=spec.cwd, stdin=spec.stdin,
                                                timeout=spec.timeout, max_output=spec.max_output)
        except CommandNotStarted as exc:
            whole, error = (exc.result, b"", b"", False), str(exc)
        if whole is None:   # too large for one request to the worker's exec server: with pipes here
            whole, error = await self._piped(worker, spec)
        result, stdout, stderr, dropped = whole
        files, unread = await self._read_back(worker, spec.read_back, len(stdout) + len(stderr))
        return CallOutcome(result, stdout, stderr, dropped, files, worker, error, unread)

    async def _read_back(self, worker: str, paths: list[str], output: int) -> tuple[dict[str, bytes], dict[str, str]]:
        """The files a call asked back, in the room its answer has left after the output (one bus message):
        a file that is not there, not a regular file or past the room is the call's outcome, named in unread
        (the command ran: its result is not lost for it); a worker gone is the node's failure (BackendError)."""
        files: dict[str, bytes] = {}
        unread: dict[str, str] = {}
        files_room, answer_room = MAX_FILES_BYTES, MAX_CALL_ANSWER - output
        for path in paths:
            answer_room -= 6 * len(path.encode()) + 256   # (its key, escaped, and a reason's room)
            room = max(0, min(files_room, answer_room))
            try:
                data = await self._workers.read_file(worker, path, room)
            except FileTooLarge:
                unread[path] = (f"larger than the {room} bytes left in the call's answer (files read back: at most "
                                f"{MAX_FILES_BYTES} in all; with the output, {MAX_CALL_ANSWER})")
                continue
            except FileError as exc:
                unread[path] = str(exc)[:200]
                continue
            files[path] = data
            files_room -= len(data)
            answer_room -= len(data)
        return files, unread

    async def _piped(self, worker: str, spec: CallSpec) -> tuple[tuple, str]:
        """The command through exec, its output pumped here (a command too large to be collected)."""
        out = {"stdout": bytearray(), "stderr": bytearray()}
        dropped = False

        async def sink(stream: str, data: bytes) -> None:
            nonlocal dropped
            buf = out[stream]
            room = spec.max_output - len(buf)
            if len(data) > room:
                dropped = True
            buf += data[:max(0, room)]

        error = ""
        try:
            result = await self._workers.exec(worker, spec.argv, env=spec.env, cwd=spec.cwd, stdin=spec.stdin or None,
                                              timeout=spec.timeout, sink=sink)
        except CommandNotStarted as exc:
            result, error = exc.result, str(exc)
        return (result, bytes(out["stdout"]), bytes(out["stderr"]), dropped), error

    async def _give_back(self, key: tuple, worker: str) -> None:
        """Wipe a used worker; to the next call of its key (or idle), retired when the wipe fails."""
        pool = self._pools.get(key)
        try:
            await self._workers.reset(worker)
        except Exception as exc:   # (not only BackendError: a worker never wiped nor retired was out of the
            log.warning("fncall worker %s retired: %s", worker, exc)   # pool for good, helper G)
            if pool is not None:
                pool.busy.discard(worker)
            await self._retire(worker)
            return
        if pool is None or self._pools.get(key) is not pool:
            await self._retire(worker)
            return
        if not self._hand_over(key, worker):
            pool.busy.discard(worker)
            pool.idle.append((worker, time.monotonic()))
        self.on_free()

    async def _retire(self, worker: str) -> None:
        try:
            await self._workers.destroy(worker)
        except BackendError as exc:
            log.error("fncall worker %s not destroyed: %s", worker, exc)
        self._hand_over((), None)   # room for a waiter of any key

    async def _retire_idle(self) -> None:
        """Every second: idle workers beyond workers_min (per key), idle for IDLE_RETIRE s, go."""
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for key, pool in list(self._pools.items()):
                keep = self.workers_min
                stale = [w for w, since in pool.idle[:max(0, len(pool.idle) - keep)] if now - since > IDLE_RETIRE]
                if stale:
                    pool.idle = [(w, s) for w, s in pool.idle if w not in stale]
                    for w in stale:
                        await self._retire(w)
                if not pool.idle and not pool.busy and not pool.starting:
                    del self._pools[key]

    # ---- what a kind without sandboxes refuses --------------------------------------------------

    async def create(self, spec: SandboxSpec) -> None:
        raise BackendError("fncall has no sandboxes to create: use client.call()")

    async def exec(self, sandbox_id, argv, *, env, cwd, stdin, timeout, sink, control=None) -> ExecResult:
        raise BackendError("fncall has no sandboxes: use client.call()")

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None:
        raise BackendError("fncall has no sandboxes: give files with the call")

    async def read_file(self, sandbox_id: str, path: str, limit: int) -> bytes:
        raise BackendError("fncall has no sandboxes: ask read_back with the call")

    async def destroy(self, sandbox_id: str) -> None:
        raise BackendError("fncall has no sandboxes")
