"""Starting a microVM's QEMU: its writable disk, its command line, the process confined as the sandbox's uid
in its groups with its agent channel and monitor connected, and a cold boot to the agent's ready frame."""
from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
from pathlib import Path

from bus import kinds
from edge.backends.base import BackendError, Limits, SandboxSpec
from edge.backends.gvisor.agent import AgentChannel
from edge.backends.gvisor.host import _join
from edge.backends.microvm import qemu
from edge.backends.microvm.qemu import disk_size, log_tail
from edge.backends.cgroups import CgroupError
from edge.backends.kernel import enter_class
from edge.backends.microvm.qmp import Qmp, QmpError
from edge.backends.microvm.vm import HOST_TASKS, READY_TIMEOUT, VM


def boot_failure(exc: BaseException, what: str, console: Path) -> BackendError | None:
    """The BackendError a failure while starting a VM becomes ("what: why"), or None for one raised as it
    is (a BackendError already, a cancellation)."""
    if isinstance(exc, (OSError, CgroupError, QmpError)):
        return BackendError(f"{what}: {exc}")
    if isinstance(exc, asyncio.TimeoutError):
        return BackendError(f"{what}: the VM did not boot within {READY_TIMEOUT:.0f}s ({log_tail(console)})")
    return None


class Booting:
    """MicroVMBackend's QEMU launch (a mixin)."""

    def _make_disk(self, vm: VM) -> None:
        """The VM's dir and its writable disk: a sparse file of the disk limit, ext4 without a journal."""
        work = self._dir(vm.key)
        work.mkdir(mode=0o700)
        disk = work / "disk.img"
        with open(disk, "wb") as f:
            f.truncate(disk_size(vm.spec.limits))
        mk = subprocess.run(["mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-E", "lazy_itable_init=1",
                             "-m", "0", str(disk)], capture_output=True, text=True)
        if mk.returncode != 0:
            raise BackendError(f"mkfs.ext4 of the VM's disk failed: {mk.stderr.strip()[-200:]}")

    def _argv(self, vm: VM, fds: dict[str, int], agent: int, monitor: int, console: int,
              ram: int | None, incoming: int | None, load: bool = False) -> list[str]:
        return qemu.argv(self.qemu, self.accel, self._guest, vm.spec, self._dir(vm.key), fds,
                         agent=agent, monitor=monitor, console=console, ram=ram, incoming=incoming,
                         machine=self.machine, load=load, tap=vm.tap, pmem=self._pmem(vm.spec))

    def _pmem(self, spec: SandboxSpec) -> int:
        """How many of spec's lowest layers are virtio-pmem devices (qemu.argv; a microVM: none, it has no PCI
        bus for them)."""
        return 0

    async def _settle(self, vm: VM) -> None:
        """Wait, before a template is saved, until its booted guest is at rest (a microVM is once its agent
        answered)."""

    def _probe_layers(self) -> list[str]:
        """The layers the KVM probe boots (a microVM: none)."""
        return []

    def _host_limits(self, limits: Limits) -> Limits:
        """The QEMU process's host groups: the VM's memory plus QEMU's own, its cpu, a backstop on threads."""
        return Limits(cpu=limits.cpu, memory=limits.memory + kinds.OVERHEAD[self.kind][0], pids=HOST_TASKS,
                      disk=limits.disk, cpu_class=limits.cpu_class)

    async def _boot(self, vm: VM, groups: dict[str, Path], ram: int | None = None,
                    timeout: float = READY_TIMEOUT) -> None:
        """Boot: start QEMU, wait for the agent's ready frame."""
        work = self._dir(vm.key)
        exited = await self._spawn(vm, groups, ram=ram)
        try:
            done, _ = await asyncio.wait({vm.chan.ready, exited}, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
            if not done:
                raise asyncio.TimeoutError
            if not vm.chan.ready.done() or vm.chan.ready.exception() is not None:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(exited), 5)
                raise BackendError(f"sandbox {vm.spec.id}: the VM stopped while booting (QEMU exit "
                                   f"{vm.proc.returncode}): {log_tail(work / 'qemu.log')} {log_tail(work / 'console.log')}")
        finally:
            if not exited.done():
                exited.cancel()

    async def _spawn(self, vm: VM, groups: dict[str, Path], *, ram: int | None = None,
                     incoming: int | None = None, load: bool = False) -> asyncio.Future:
        """Start QEMU as the sandbox's uid inside its groups, its agent channel and monitor connected;
        a future of its exit."""
        work = self._dir(vm.key)
        files = {"trusted": (self._guest.trusted, os.O_RDONLY), "disk": (work / "disk.img", os.O_RDWR),
                 "disk_ro": (work / "disk.img", os.O_RDONLY)}
        files.update({f"layer_{i}": (Path(p), os.O_RDONLY) for i, p in enumerate(vm.spec.layers)})
        fds: dict[str, int] = {}
        host_a, guest_a = socket.socketpair()
        host_m, guest_m = socket.socketpair()
        log = os.open(work / "qemu.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        console = os.open(work / "console.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            for name, (path, flags) in files.items():
                fds[name] = os.open(path, flags | os.O_CLOEXEC)
            tasks = [str(g / "tasks") for g in groups.values()]
            uid = vm.ids.base

            hide = [self.state_dir, *{Path(p).parent for p in vm.spec.layers if not p.startswith("/proc/")},
                    *vm.hide, Path("/dev/shm"), Path("/run/dsec")]
            kvm = self.accel == "kvm"

            argv = self._argv(vm, fds, guest_a.fileno(), guest_m.fileno(), console, ram, incoming, load)

            def become() -> None:
                _join(tasks)
                enter_class(vm.spec.limits.cpu_class)
                qemu.confine(uid, hide, self._guest.kernel, kvm, argv[0])
            extra = [fd for fd in (ram, incoming, vm.tap) if fd is not None]
            try:
                vm.proc = await asyncio.create_subprocess_exec(
                    *argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                    pass_fds=[*fds.values(), console, guest_a.fileno(), guest_m.fileno(), *extra], preexec_fn=become)
            except subprocess.SubprocessError as exc:    # confine() failed in the child
                raise BackendError(f"sandbox {vm.spec.id}: QEMU could not be confined: {exc}") from exc
        finally:
            for fd in (*fds.values(), log, console):
                os.close(fd)
            if vm.tap is not None:     # QEMU has its own: the tap lives as long as QEMU
                os.close(vm.tap)
                vm.tap = None
            guest_a.close()
            guest_m.close()
        vm.qmp = Qmp(host_m)
        r = host_a.detach()
        vm.chan = AgentChannel(vm.spec.id, os.dup(r), r)
        return asyncio.ensure_future(vm.proc.wait())

    def _exited(self, vm: VM) -> None:
        """QEMU ended while nobody destroyed its VM (the guest crashed, powered off or was killed): told to
        the edge, which destroys the sandbox as failed."""
        if vm.dying is None and self._vms.get(vm.spec.id) is vm and self.died is not None:
            self.died(vm.spec.id, f"its VM exited (QEMU status {vm.proc.returncode}: "
                                  f"{log_tail(self._dir(vm.key) / 'console.log')})")
