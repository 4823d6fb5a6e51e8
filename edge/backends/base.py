"""The backend contract: lifecycle (start/stop/reconcile) apart from work (create/exec/files/destroy).

Each backend is one kind (bus/kinds.py) and declares what it can do there; the edge holds its backends by
kind (edge/backends/registry.py) and never reaches into one. A backend lacking an operation raises
Unsupported-worthy BackendErrors only as a last guard: the SDK, placement and the edge's op lane refuse
such operations from the capability table first."""
from __future__ import annotations

import abc
from typing import Callable
from dataclasses import dataclass, field

from chronus.control import ExecControl, ExecResult, OutputSink, StreamName  # noqa: F401  (the exec contract)
from chronus.shell import TRUSTED_DIR, TRUSTED_SHELL  # noqa: F401  (the trusted shell every backend mounts)
from bus import kinds
from bus.network import Network


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandbox, already parsed to plain numbers."""

    cpu: float = 1.0            # cores; becomes a CFS quota
    memory: int = 256 << 20     # bytes; memory+swap is capped at the same value
    pids: int = 256             # max tasks in the sandbox's pids cgroup
    disk: int = 256 << 20       # bytes the writable layer may hold
    cpu_class: str = "latency"  # batch: low cpu shares and SCHED_IDLE for every process (cgroups.py)


@dataclass(frozen=True)
class SandboxSpec:
    """What the edge asks a backend to start."""

    id: str                     # sandbox id; also its hostname
    layers: list[str]           # local paths of EROFS layer files, lowest first
    limits: Limits = field(default_factory=Limits)
    env: dict[str, str] = field(default_factory=dict)   # default env of every exec
    kind: str = "container"     # which of the edge's backends runs it
    scratch: int = 0            # > 0: read-only root, a tmpfs of this size at /tmp, an IPC namespace per
                                # command (a stateless worker: see edge/backends/fncall/)
    warm: bool = False          # started for a warm pool: worth a longer create for a faster first command
    privileged: bool = False    # a VM's commands keep every capability of the guest (kinds: "privileged")
    memory: str = ""            # start from this memory snapshot the backend holds (save_memory), not layers
    network: Network | None = None   # its network policy (Aether); None or mode none: loopback only
    cwd: str = ""               # every exec's default cwd ("": /) and user ("": root): an imported image's
    user: str = ""
    tenant: str = ""            # whose it is (the node's proxy shares its connections out by tenant)


class BackendError(Exception):
    """A backend could not do what was asked; the message is one clear line."""


class LayerUnusable(BackendError):
    """A layer file of the node's cache could not be used (e.g. it does not mount): fetch it again."""


class SnapshotGone(BackendError):
    """A create from a memory snapshot this node no longer holds (its edge restarted, or it was deleted)."""


class SpecRefused(BackendError):
    """A create this backend will not start as asked, wherever it runs (e.g. a fork from a privileged VM's
    memory that does not ask to be privileged): the request's fault, not the node's."""


class CapacityExhausted(BackendError):
    """The host ran out of something every sandbox needs (a uid range, a kernel count): the create is
    refused (CapacityUnavailable, naming it); the node stays healthy."""


class SnapshotTooLarge(BackendError):
    """A snapshot would pack more than the sandbox's disk limit, or a tree a layer cannot hold (a name of
    255 bytes, a path too deep for the packer): refused, InvalidRequest."""


class SandboxGone(BackendError):
    """The sandbox does not exist (never created, or destroyed)."""


class CommandNotStarted(BackendError):
    """The command never started (not found, bad cwd...); .result carries exit_code -1."""

    def __init__(self, message: str, result: ExecResult) -> None:
        super().__init__(message)
        self.result = result


class Backend(abc.ABC):
    """One kind of sandbox. Lifecycle: start/stop/reconcile. Work: create/exec/files/destroy."""

    kind: str = ""                  # its name in bus/kinds.py
    died: Callable[[str, str], None] | None = None   # set by the edge: (sandbox id, why) for one that ended
                                                     # by itself (a VM whose kernel crashed); it destroys it
    accel: str = ""                 # a VM kind's accelerator once started (kvm or tcg); '' for the others
    network = None                  # set by the edge: the node's Aether (aether/node.py), None without one
    trusted_shell: str = TRUSTED_SHELL   # the shell string commands run with, inside its sandboxes

    async def attach_network(self, spec: SandboxSpec):
        """The one network hook: the sandbox's network end from the node's Aether (aether/node.py), its
        policy in force; None for loopback only. The backend joins its sandbox to end.netns and calls
        self.network.detach(spec.id) when the sandbox is gone."""
        if spec.network is None or spec.network.mode == "none":
            return None
        if self.network is None:
            raise SpecRefused(f"sandbox {spec.id}: this node runs no Aether (network {spec.network.mode!r} "
                              f"needs it: dsec edge without --no-aether)")
        try:
            return await self.network.attach(spec.id, spec.network, tenant=spec.tenant)
        except Exception as exc:
            raise BackendError(f"sandbox {spec.id}: its network: {exc}") from exc

    async def network_in_force(self, spec: SandboxSpec) -> None:
        """Wait until the policy attach_network began to apply is in force (before the sandbox runs anything
        of its own); BackendError if it could not be."""
        try:
            await self.network.in_force(spec.id)
        except Exception as exc:
            raise BackendError(f"sandbox {spec.id}: its network policy: {exc}") from exc

    @property
    def capabilities(self) -> frozenset[str]:
        """What its sandboxes offer (the shared table: the SDK and placement refuse the rest)."""
        return kinds.CAPABILITIES.get(self.kind, frozenset())

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

    async def file_op(self, sandbox_id: str, op, user=None) -> bytes:
        """One file-tree op (bus.messages.FileOp) in the sandbox's root as user (users.ExecUser; None: its
        root); its encoded FileOpResult. Kinds with the file_tree capability have it."""
        raise BackendError(f"{type(self).__name__} has no file-tree operations")

    async def watch(self, sandbox_id: str, path: str, recursive: bool, *, timeout: float, sink: OutputSink,
                    control: ExecControl | None = None) -> ExecResult:
        """Hand a directory's changes to sink (stdout, JSON lines: edge/backends/watcher.py) until control's
        signal or the timeout. Kinds with the watch capability have it."""
        raise BackendError(f"{type(self).__name__} has no directory watches")

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

    async def save_memory(self, sandbox_id: str, name: str) -> int:
        """Keep the sandbox's memory and device state (and its disk as it was then) as `name`, from which
        creates with SandboxSpec.memory=name go on; the bytes of RAM it holds."""
        raise BackendError(f"{type(self).__name__} cannot snapshot memory")

    def memories(self) -> list[str]:
        """The memory snapshots this backend holds."""
        return []

    def drop_memory(self, name: str) -> None:
        """Forget a memory snapshot (VMs started from it keep what they mapped)."""

    async def freeze(self, sandbox_id: str) -> None:
        """Stop every process of a sandbox where it is (no CPU, memory kept) until thaw()."""
        raise BackendError(f"{type(self).__name__} cannot suspend sandboxes")

    async def thaw(self, sandbox_id: str) -> None:
        """Let a frozen sandbox's processes run on from where they were."""
        raise BackendError(f"{type(self).__name__} cannot resume sandboxes")

    @abc.abstractmethod
    def sandboxes(self) -> list[str]:
        """Ids of the sandboxes this backend runs now."""

    def residue(self, sandbox_id: str) -> list[str]:
        """What a destroyed sandbox left on the host (mounts, cgroups, processes...): [] when nothing.
        The leak checks of tests and chaos ask this, never a backend's internals."""
        return []

    def leftovers(self) -> list[str]:
        """Everything of this backend's sandboxes still on the host (after stop(): [] when nothing leaked)."""
        return []

    def busy(self) -> bool:
        """Whether a sandbox runs, starts or is being destroyed now."""
        return bool(self.sandboxes())

    def leaks(self) -> list[str]:
        """While it runs and holds no sandbox: what it should not hold any more (layer references, untracked
        mounts, writable layers...): [] when nothing leaked."""
        return []
