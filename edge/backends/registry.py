"""The backends an edge runs, by kind: one config struct per kind (`type` names it, unknown fields are
refused, build() imports the backend only then), a cheap check of what this machine can run, and
BackendSet, which the edge holds in place of a single backend and which routes each call to the backend
of the sandbox's kind.

    configs = [config_for("container"), config_for("fncall", workers_min=2)]
    backends = BackendSet.build(configs, state_dir, node_id)
"""
from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path
from typing import Union

import msgspec

from bus import kinds
from bus.errors import InvalidRequest
from edge.backends.base import Backend, BackendError, ExecControl, ExecResult, OutputSink, SandboxGone, SandboxSpec

log = logging.getLogger(__name__)


class _Config(msgspec.Struct, forbid_unknown_fields=True, tag_field="type", frozen=True):
    """What every backend config can answer (its slots are the edge's: EdgeConfig.kind_slots)."""

    def available(self) -> str:
        """'' when this machine has what the backend needs (a cheap check: no boot), else why not."""
        return ""


class ContainerConfig(_Config, tag=kinds.CONTAINER):
    """Namespaces, cgroups and overlayfs over EROFS layers (edge/backends/container/)."""

    upper_pool_size: int = 64 << 30  # bytes of the btrfs pool that holds the writable layers
    init_binary: str = "/usr/bin/catatonit"

    def available(self) -> str:
        missing = [t for t in ("mkfs.erofs", "mkfs.btrfs", "busybox") if shutil.which(t) is None]
        return f"missing {', '.join(missing)} (make setup installs them)" if missing else ""

    def build(self, state_dir: Path, node_id: str) -> Backend:
        from edge.backends.container import ContainerBackend
        return ContainerBackend(state_dir, node_id, upper_pool_size=self.upper_pool_size,
                                init_binary=self.init_binary)


class FnCallConfig(_Config, tag=kinds.FNCALL):
    """Pre-started stateless workers for client.call (edge/backends/fncall/)."""

    workers_min: int = 2             # workers kept started per image when idle
    workers_max: int = 32            # workers at most, all images together
    scratch: int = 64 << 20          # bytes of each worker's tmpfs scratch

    def available(self) -> str:
        return ContainerConfig().available()   # its workers are container sandboxes

    def build(self, state_dir: Path, node_id: str) -> Backend:
        from edge.backends.fncall import FnCallBackend
        return FnCallBackend(state_dir, node_id, workers_min=self.workers_min, workers_max=self.workers_max,
                             scratch=self.scratch)


class GvisorConfig(_Config, tag=kinds.GVISOR):
    """The same layered rootfs under gVisor's runsc (edge/backends/gvisor/)."""

    runsc: str = "runsc"
    platform: str = "ptrace"

    def available(self) -> str:
        return "" if shutil.which(self.runsc) else f"{self.runsc} not found (make setup installs Debian's runsc)"

    def build(self, state_dir: Path, node_id: str) -> Backend:
        from edge.backends.gvisor import GvisorBackend
        return GvisorBackend(state_dir, node_id, runsc=self.runsc, platform=self.platform)


class MicroVMConfig(_Config, tag=kinds.MICROVM):
    """QEMU -M microvm, Debian's cloud kernel and dsec-agent as the guest's pid 1 (edge/backends/microvm/)."""

    qemu: str = "qemu-system-x86_64"
    accel: str = "auto"         # kvm where a guest boots under it (probed once at start), else tcg
    templates: bool = True      # creates restore a saved VM per (layers, size) instead of booting

    def available(self) -> str:
        if shutil.which(self.qemu) is None:
            return f"{self.qemu} not found (make setup installs Debian's qemu-system-x86)"
        from edge.backends.microvm import guest
        return guest.missing()

    def build(self, state_dir: Path, node_id: str) -> Backend:
        from edge.backends.microvm import MicroVMBackend
        return MicroVMBackend(state_dir, node_id, qemu=self.qemu, accel=self.accel, templates=self.templates)


class FullVMConfig(MicroVMConfig, tag=kinds.FULLVM):
    """QEMU -M q35 booting a whole Debian whose systemd the agent starts (edge/backends/fullvm/): a
    microVM's settings and needs, and the OS layer."""

    def available(self) -> str:
        from edge.backends.fullvm import osimage
        return super().available() or osimage.missing()

    def build(self, state_dir: Path, node_id: str) -> Backend:
        from edge.backends.fullvm import FullVMBackend
        return FullVMBackend(state_dir, node_id, qemu=self.qemu, accel=self.accel, templates=self.templates)


class NoopConfig(_Config, tag=kinds.NOOP):
    """Sandboxes that are names only (tests and benchmarks of the bus; never advertised by `dsec up`)."""

    def build(self, state_dir: Path, node_id: str) -> Backend:
        from edge.backends.noop import NoopBackend
        return NoopBackend()


BackendConfig = Union[ContainerConfig, FnCallConfig, GvisorConfig, MicroVMConfig, FullVMConfig, NoopConfig]


def config_for(kind: str, **fields: object) -> BackendConfig:
    """The config of a kind from plain fields; InvalidRequest for an unknown kind or field."""
    kinds.check_kind(kind)
    try:
        return msgspec.convert({"type": kind, **fields}, BackendConfig)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"backend {kind}: {exc}") from None


def kind_of_config(cfg: BackendConfig) -> str:
    """The kind a config is for (its `type`)."""
    return type(cfg).__struct_config__.tag


def runnable() -> list[str]:
    """The kinds this machine can run (what `dsec up` enables), each checked cheaply."""
    out = []
    for kind in kinds.SERVED:
        why = config_for(kind).available()
        if why:
            log.info("backend %s not enabled: %s", kind, why)
        else:
            out.append(kind)
    return out


def kind_dir(state_dir: Path, kind: str) -> Path:
    """Where a kind's backend keeps its state on a node whose edge state is state_dir."""
    state_dir = Path(state_dir)
    return state_dir if kind == kinds.CONTAINER else state_dir.with_name(f"{state_dir.name}-{kind}")


def node_leftovers(state_dir: Path, node_id: str) -> list[str]:
    """Everything any backend of a node (its state under state_dir) left on the host, without starting
    one: what leak checks ask after an edge stopped or crashed."""
    from edge.backends.container import leftovers
    out = leftovers(state_dir, node_id)
    state_dir = Path(state_dir)
    if kind_dir(state_dir, kinds.FNCALL).exists():   # the fncall workers' own container backend
        out += leftovers(kind_dir(state_dir, kinds.FNCALL), f"{node_id}.fn")
    if kind_dir(state_dir, kinds.GVISOR).exists():
        from edge.backends.gvisor import leftovers as gvisor_leftovers
        out += gvisor_leftovers(kind_dir(state_dir, kinds.GVISOR), node_id)
    if kind_dir(state_dir, kinds.MICROVM).exists():
        from edge.backends.microvm import leftovers as microvm_leftovers
        out += microvm_leftovers(kind_dir(state_dir, kinds.MICROVM), node_id)
    if kind_dir(state_dir, kinds.FULLVM).exists():
        from edge.backends.fullvm import leftovers as fullvm_leftovers
        out += fullvm_leftovers(kind_dir(state_dir, kinds.FULLVM), node_id)
    return out


class BackendSet(Backend):
    """The edge's backends by kind, behind the one Backend interface: create goes to the spec's kind,
    every other call to the kind of the sandbox it names (SandboxGone for an id none of them runs)."""

    kind = "set"

    def __init__(self, backends: dict[str, Backend], optional: frozenset[str] = frozenset()) -> None:
        if not backends:
            raise BackendError("an edge needs at least one backend")
        self.backends = backends
        self.optional = optional   # kinds that were found, not asked for: one that fails to start is dropped
        self._kind_of: dict[str, str] = {}

    @classmethod
    def build(cls, configs: list[BackendConfig], state_dir: Path, node_id: str,
              optional: frozenset[str] = frozenset()) -> "BackendSet":
        """Each config's backend: the container backend's state in state_dir (as before kinds existed),
        any other kind's beside it in <state_dir>-<kind> (never under it: the container backend's
        reconcile unmounts everything under its own dir)."""
        out: dict[str, Backend] = {}
        for cfg in configs:
            kind = kind_of_config(cfg)
            if kind in out:
                raise InvalidRequest(f"backend {kind} given twice")
            out[kind] = cfg.build(kind_dir(state_dir, kind), node_id)
        return cls(out, optional)

    @property
    def kinds(self) -> list[str]:
        """The kinds it runs."""
        return list(self.backends)

    @property
    def died(self):
        return getattr(self, "_died", None)

    @died.setter
    def died(self, hook) -> None:
        """The edge's hook for sandboxes that end by themselves, handed to every backend."""
        self._died = hook
        for b in self.backends.values():
            b.died = hook

    @property
    def network(self):
        return getattr(self, "_network", None)

    @network.setter
    def network(self, aether) -> None:
        """The node's Aether (or None), handed to every backend."""
        self._network = aether
        for b in self.backends.values():
            b.network = aether

    @property
    def accelerators(self) -> dict[str, str]:
        """kind -> the accelerator its VMs run with (kvm or tcg), for the kinds that run VMs."""
        return {k: b.accel for k, b in self.backends.items() if getattr(b, "accel", "")}

    def of(self, sandbox_id: str) -> Backend:
        """The backend running this sandbox."""
        kind = self._kind_of.get(sandbox_id)
        if kind is None:
            raise SandboxGone(f"no such sandbox: {sandbox_id}")
        return self.backends[kind]

    def kind_of(self, sandbox_id: str) -> str:
        """The kind of a sandbox it runs ('' when none)."""
        return self._kind_of.get(sandbox_id, "")

    def trusted_shell_of(self, sandbox_id: str) -> str:
        """The shell a sandbox's string commands run with."""
        return self.of(sandbox_id).trusted_shell

    # ---- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Start every backend. One that was only found (optional) and fails is dropped with a warning;
        one asked for that fails stops the ones started again, and the error names it."""
        started: list[Backend] = []
        for kind, backend in list(self.backends.items()):
            try:
                await backend.start()
            except BackendError as exc:
                if kind in self.optional and len(self.backends) > 1:
                    log.warning("backend %s not enabled: it failed to start: %s", kind, exc)
                    del self.backends[kind]
                    continue
                await asyncio.gather(*(b.stop() for b in started), return_exceptions=True)
                raise BackendError(f"{kind}: {exc}") from exc
            started.append(backend)

    async def stop(self) -> None:
        """Stop every backend (all of them, whatever one raises)."""
        results = await asyncio.gather(*(b.stop() for b in self.backends.values()), return_exceptions=True)
        self._kind_of.clear()
        errors = [f"{k}: {r}" for k, r in zip(self.backends, results) if isinstance(r, BaseException)]
        if errors:
            raise BackendError("; ".join(errors))

    def sandboxes(self) -> list[str]:
        return [i for b in self.backends.values() for i in b.sandboxes()]

    def residue(self, sandbox_id: str) -> list[str]:
        return [r for b in self.backends.values() for r in b.residue(sandbox_id)]

    def leftovers(self) -> list[str]:
        return [r for b in self.backends.values() for r in b.leftovers()]

    def busy(self) -> bool:
        return any(b.busy() for b in self.backends.values())

    def leaks(self) -> list[str]:
        return [f"{k}: {r}" for k, b in self.backends.items() for r in b.leaks()]

    # ---- work ---------------------------------------------------------------------------------

    async def create(self, spec: SandboxSpec) -> None:
        backend = self.backends.get(spec.kind)
        if backend is None:
            raise BackendError(f"this node does not run backend {spec.kind!r} (it runs: {', '.join(self.backends)})")
        if spec.id in self._kind_of:
            raise BackendError(f"sandbox already exists: {spec.id}")
        self._kind_of[spec.id] = spec.kind   # before the await: a destroy meanwhile finds its backend
        try:
            await backend.create(spec)
        except BaseException:
            self._kind_of.pop(spec.id, None)
            raise

    async def claim(self, warm_id: str, spec: SandboxSpec) -> None:
        backend = self.of(warm_id)
        if spec.kind != self._kind_of[warm_id]:
            raise BackendError(f"warm sandbox {warm_id} is {self._kind_of[warm_id]}, not {spec.kind}")
        await backend.claim(warm_id, spec)
        self._kind_of[spec.id] = self._kind_of.pop(warm_id)

    async def exec(self, sandbox_id: str, argv: list[str], *, env: dict[str, str], cwd: str,
                   stdin: bytes | None, timeout: float, sink: OutputSink,
                   control: ExecControl | None = None, user=None, pty=None) -> ExecResult:
        extra = {"user": user} if user is not None else {}   # (kinds with "users" only: edge/sandboxes.py)
        if pty is not None:                                   # (kinds with "pty" only)
            extra["pty"] = pty
        return await self.of(sandbox_id).exec(sandbox_id, argv, env=env, cwd=cwd, stdin=stdin, timeout=timeout,
                                              sink=sink, control=control, **extra)

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None:
        await self.of(sandbox_id).write_file(sandbox_id, path, data, mode)

    async def read_file(self, sandbox_id: str, path: str, limit: int) -> bytes:
        return await self.of(sandbox_id).read_file(sandbox_id, path, limit)

    async def file_op(self, sandbox_id: str, op, user=None) -> bytes:
        return await self.of(sandbox_id).file_op(sandbox_id, op, **({"user": user} if user is not None else {}))

    async def watch(self, sandbox_id: str, path: str, recursive: bool, *, timeout: float, sink: OutputSink,
                    control: ExecControl | None = None) -> ExecResult:
        return await self.of(sandbox_id).watch(sandbox_id, path, recursive, timeout=timeout, sink=sink,
                                               control=control)

    async def destroy(self, sandbox_id: str) -> None:
        backend = self.of(sandbox_id)
        try:
            await backend.destroy(sandbox_id)
        finally:
            if sandbox_id not in backend.sandboxes():
                self._kind_of.pop(sandbox_id, None)

    async def pack_upper(self, sandbox_id: str, dst: str) -> str:
        return await self.of(sandbox_id).pack_upper(sandbox_id, dst)

    async def save_memory(self, sandbox_id: str, name: str) -> int:
        return await self.of(sandbox_id).save_memory(sandbox_id, name)

    def memories(self) -> list[str]:
        return [m for b in self.backends.values() for m in b.memories()]

    def drop_memory(self, name: str) -> None:
        for b in self.backends.values():
            b.drop_memory(name)

    async def freeze(self, sandbox_id: str) -> None:
        await self.of(sandbox_id).freeze(sandbox_id)

    async def thaw(self, sandbox_id: str) -> None:
        await self.of(sandbox_id).thaw(sandbox_id)
