"""The backend contract: lifecycle (start/stop/reconcile) apart from work (create/exec/files/destroy)."""
from __future__ import annotations

import abc
import asyncio
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Literal

from chronus.shell import TRUSTED_DIR, TRUSTED_SHELL  # noqa: F401  (the trusted shell every backend mounts)

StreamName = Literal["stdout", "stderr"]
# Called with each chunk read from a command's stdout or stderr, in the order read.
# Awaited before the next read of that stream, so a slow consumer slows the reader (no unbounded buffering).
OutputSink = Callable[[StreamName, bytes], Awaitable[None]]


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandbox, already parsed to plain numbers."""

    cpu: float = 1.0            # cores; becomes a CFS quota
    memory: int = 256 << 20     # bytes; memory+swap is capped at the same value
    pids: int = 256             # max tasks in the sandbox's pids cgroup
    disk: int = 256 << 20       # bytes the writable layer may hold


@dataclass(frozen=True)
class SandboxSpec:
    """What the edge asks a backend to start."""

    id: str                     # sandbox id; also its hostname
    layers: list[str]           # local paths of EROFS layer files, lowest first
    limits: Limits = field(default_factory=Limits)
    env: dict[str, str] = field(default_factory=dict)   # default env of every exec


@dataclass(frozen=True)
class ExecResult:
    """How one command ended."""

    exit_code: int              # 128+n when killed by signal n; -1 when it never started
    duration: float             # seconds, wall clock
    cpu_time: float             # seconds of CPU used by the command's cgroup
    peak_memory: int            # bytes, max usage of the command's cgroup
    timed_out: bool = False     # killed because the timeout passed (tree verified gone)


class ExecControl:
    """A running exec's live controls, given by the edge to Backend.exec: stdin written while the
    command runs (in order; each write resolves True once the pipe took it, False when the command's
    stdin is gone) and signals to its processes."""

    def __init__(self, live_stdin: bool = False) -> None:
        self.live_stdin = live_stdin      # stdin comes through write(), after the request's bytes
        self._queue: asyncio.Queue[tuple[bytes | None, asyncio.Future]] = asyncio.Queue()
        self._signal: Callable[[int], Awaitable[bool]] | None = None
        self.closed = False

    def write(self, data: bytes | None) -> asyncio.Future:
        """Queue stdin bytes (None: end of stdin); the future says whether they were written."""
        fut = asyncio.get_running_loop().create_future()
        if self.closed:
            fut.set_result(False)
        else:
            self._queue.put_nowait((data, fut))
        return fut

    async def next_input(self) -> tuple[bytes | None, asyncio.Future]:
        """For the backend: the next stdin piece and its future."""
        return await self._queue.get()

    def close(self) -> None:
        """The command's stdin is gone (or the exec ended): every queued and later write fails."""
        self.closed = True
        self._signal = None
        while not self._queue.empty():
            _, fut = self._queue.get_nowait()
            if not fut.done():
                fut.set_result(False)

    def on_signal(self, fn: Callable[[int], Awaitable[bool]]) -> None:
        """For the backend: how to signal the exec's processes."""
        self._signal = fn

    async def signal(self, sig: int) -> bool:
        """Send sig to every process of the exec; False when it is not running (yet, or any more)."""
        return await self._signal(sig) if self._signal is not None else False


class BackendError(Exception):
    """A backend could not do what was asked; the message is one clear line."""


class LayerUnusable(BackendError):
    """A layer file of the node's cache could not be used (e.g. it does not mount): fetch it again."""


class SandboxGone(BackendError):
    """The sandbox does not exist (never created, or destroyed)."""


class Backend(abc.ABC):
    """One kind of sandbox. Lifecycle: start/stop/reconcile. Work: create/exec/files/destroy."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Prepare the node (reconcile leftovers first), ready to create sandboxes."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Destroy every sandbox and release every node resource (mounts, cgroups, processes)."""

    @abc.abstractmethod
    async def create(self, spec: SandboxSpec) -> None:
        """Start a sandbox; raises BackendError with a clear message on failure (nothing leaked)."""

    @abc.abstractmethod
    async def exec(self, sandbox_id: str, argv: list[str], *, env: dict[str, str], cwd: str,
                   stdin: bytes | None, timeout: float, sink: OutputSink,
                   control: ExecControl | None = None) -> ExecResult:
        """Run argv inside the sandbox; stream output to sink; return when it exited and its pipes closed.
        With control: stdin continues from control's writes (when live_stdin) and signals reach it."""

    @abc.abstractmethod
    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None:
        """Write a file inside the sandbox's root (symlinks resolved inside the root)."""

    @abc.abstractmethod
    async def read_file(self, sandbox_id: str, path: str, limit: int) -> bytes:
        """Read a file inside the sandbox's root (symlinks resolved inside the root)."""

    @abc.abstractmethod
    async def destroy(self, sandbox_id: str) -> None:
        """Kill every process, unmount, remove cgroups and the writable layer. Idempotent."""

    async def claim(self, warm_id: str, spec: SandboxSpec) -> None:
        """Give a running sandbox nobody has used yet (a warm one, started with spec's layers and limits)
        spec's id, hostname and default env; on failure it is left as it was."""
        raise BackendError(f"{type(self).__name__} cannot hand out warm sandboxes")

    async def pack_upper(self, sandbox_id: str, dst: str) -> str:
        """Pack the sandbox's writable layer (its diff over its layers: files, modes, links, whiteouts)
        into the EROFS file dst while its processes are frozen; return the file's digest."""
        raise BackendError(f"{type(self).__name__} cannot snapshot sandboxes")

    async def freeze(self, sandbox_id: str) -> None:
        """Stop every process of a sandbox where it is (no CPU, memory kept) until thaw()."""
        raise BackendError(f"{type(self).__name__} cannot suspend sandboxes")

    async def thaw(self, sandbox_id: str) -> None:
        """Let a frozen sandbox's processes run on from where they were."""
        raise BackendError(f"{type(self).__name__} cannot resume sandboxes")

    @abc.abstractmethod
    def sandboxes(self) -> list[str]:
        """Ids of the sandboxes this backend runs now."""
