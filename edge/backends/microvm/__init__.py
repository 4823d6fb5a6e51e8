"""MicroVM sandboxes: `qemu-system-x86_64 -M microvm` with Debian's cloud kernel, the guest's own kernel
between the sandbox and the host's (guest.py builds what it boots, init.sh is its /init).

Per sandbox, a QEMU process:
- runs as the sandbox's unprivileged host uid (an idmap range's base), with `-sandbox on` (seccomp: no
  spawning, no privilege changes), in the sandbox's host cgroups (memory = the VM's size plus QEMU's
  own, cpu, pids), so a kill of its freezer group ends it whatever it does;
- opens nothing by path but the kernel and initramfs: the edge (root) opens each drive and hands QEMU the
  fd (`-add-fd`), so the layer cache and the state dir stay private;
- gets the image's EROFS layers as read-only virtio-blk drives (the same files every VM of the node and
  every container use: one copy in the host's page cache), a sparse ext4 disk of the disk limit as the
  writable layer, and the trusted device (dsec-agent and the trusted shell, EROFS, read-only);
- has one network device, on a tap bridged to its sandbox's veth when it has a network (net.py, aether/),
  else on an empty hub; no display, no reboot.
The guest's pid 1 is dsec-agent, which speaks the same framed channel as in a gVisor sandbox
(gvisor/agent.py) over a virtio-serial port whose host end is one end of a socketpair; QEMU's monitor
(QMP) is a second socketpair, used for suspend (stop/cont). Files are read and written by the trusted
shell inside the guest, so paths resolve in the guest's root and nowhere else.

Its parts: vm.py (one VM's state), boot.py (QEMU's launch and a cold boot), restore.py and template.py
(templates), memory.py (memory snapshots), snapshot.py (the writable layer packed as a layer), qemu.py
(the command line, confinement), qmp.py, accel.py, guest.py (what the guest boots).
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from bus import kinds
from edge.backends import cgroups, idmap
from edge.backends.base import (Backend, BackendError, ExecControl, ExecResult, Limits, OutputSink, SandboxGone,
                                SandboxSpec, SnapshotGone, TRUSTED_SHELL)
from chronus.shell import TRUSTED_BUSYBOX
from edge.backends.cgroups import CgroupError, NodeCgroups
from edge.backends.gvisor.host import _remove_groups, valid_id
from edge.backends.microvm import accel, guest, snapshot, template
from edge.backends.microvm.boot import Booting, boot_failure
from edge.backends.treeops import remove_path
from edge.backends.microvm.files import GuestFiles
from edge.backends.microvm.memory import MemorySnapshots, fork_spec
from edge.backends.microvm.net import Networking
from edge.backends.microvm.restore import Restoring
from edge.backends.microvm.vm import VM
from edge.backends.microvm.qemu import qemu_processes

__all__ = ["MicroVMBackend", "VM", "leftovers"]

CLAIMED_KEPT = 4096         # claimed ids remembered for residue() after their destroy
DEFAULT_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root"}


class MicroVMBackend(GuestFiles, MemorySnapshots, Restoring, Booting, Networking, Backend):
    """One QEMU microvm per sandbox, its commands run by the guest's agent."""

    kind = kinds.MICROVM
    machine = "microvm"

    def __init__(self, state_dir: Path, node_id: str, *, qemu: str = "qemu-system-x86_64",
                 accel: str = "auto", templates: bool = True) -> None:
        self.state_dir = Path(state_dir).resolve()
        self.node_id = node_id
        self.label = f"{node_id}.{self.kind}"
        self.qemu = shutil.which(qemu) or qemu
        self.requested_accel = accel
        self.accel = "tcg" if accel == "auto" else accel     # resolved by start()
        self._cgroups = NodeCgroups(self.label)
        self._ids = idmap.Allocator(self.label)
        self._vms: dict[str, VM] = {}
        self._guest: guest.Guest | None = None
        self.use_templates = templates
        self._claimed: dict[str, str] = {}     # id -> key of sandboxes claimed from a warm pool (for residue())
        self._templates = template.Templates(self.state_dir / "templates")
        self._memory_init()

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Build (or find) the guest's boot files, reconcile a crashed run's VMs, prepare cgroups."""
        try:
            self._guest = await asyncio.to_thread(guest.build)
        except (guest.GuestError, OSError) as exc:
            raise BackendError(f"{self.kind} backend failed to start: {exc}") from exc
        try:
            accel.choose(self.requested_accel, True, None)      # a bad name fails before anything starts
        except accel.AccelError as exc:
            raise BackendError(f"{self.kind} backend failed to start: {exc}") from exc
        self.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.state_dir, 0o700)
        await self._reconcile()
        try:
            self._cgroups.setup()
            (self.state_dir / "vms").mkdir(exist_ok=True)
            self.accel = await accel.resolve(self.requested_accel, guest.cache_dir() / "accel.json",
                                             accel.host_key(_qemu_version(self.qemu), self._guest.version,
                                                           self.machine),
                                             self._probe_kvm)
        except (OSError, CgroupError, accel.AccelError) as exc:
            await self._reconcile()
            raise BackendError(f"{self.kind} backend failed to start: {exc}") from exc

    async def _reconcile(self) -> None:
        """Kill every QEMU of this node (its cgroups), remove its groups, VM dirs and templates, free its uid
        leases."""
        await self._templates.clear()        # a crashed edge's templates died with it (their RAM is memfds)
        self._memory_clear()                 # and so did its memory snapshots
        problems = await self._cgroups.reconcile()
        for pid in qemu_processes(self.state_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):   # (a pack's work dir in it may be a tree of any depth)
            remove_path(self.state_dir / "vms")
        if not problems:
            self._ids.setup()
            await asyncio.to_thread(self._ids.reclaim)
        if problems:
            raise BackendError(f"cannot clean up microvm node {self.node_id}: {'; '.join(problems)}")

    async def stop(self) -> None:
        try:
            results = await asyncio.gather(*(self.destroy(i) for i in list(self._vms)), return_exceptions=True)
        finally:
            await self._reconcile()
        errors = [str(r) for r in results if isinstance(r, Exception) and not isinstance(r, SandboxGone)]
        if errors:
            raise BackendError(f"stop: {'; '.join(errors)}")

    def sandboxes(self) -> list[str]:
        return [i for i, vm in self._vms.items() if vm.dying is None]

    # ------------------------------------------------------------ create / destroy

    def _dir(self, sandbox_id: str) -> Path:
        return self.state_dir / "vms" / sandbox_id

    async def create(self, spec: SandboxSpec) -> None:
        """Boot a VM; returns once its agent answered. Nothing is left behind on failure."""
        if not valid_id(spec.id):
            raise BackendError(f"invalid sandbox id: {spec.id!r}")
        if spec.id in self._vms:
            raise BackendError(f"sandbox already exists: {spec.id}")
        least = kinds.MIN_MEMORY[self.kind]
        if spec.limits.memory < least:
            raise BackendError(f"a {self.kind} needs at least {least >> 20} MiB of memory, "
                               f"asked {spec.limits.memory >> 20} MiB")
        vm = self._vms[spec.id] = VM(spec, idmap.IdRange(-1))
        try:
            vm.ids = self._ids.lease(vm.key)
            groups = self._cgroups.create_sandbox(vm.key, self._host_limits(spec.limits))
            if spec.memory:
                try:
                    image = self.memory_image(spec.memory)
                except BackendError as exc:
                    raise SnapshotGone(str(exc)) from None
                vm.spec = fork_spec(image, spec)
                vm.hide = sorted({Path(p).parent for p in image.spec.layers})
                await self._attach(vm)
                await self._restore(vm, groups, image.tpl, fork=True)
            elif self.use_templates:
                tpl = await self._template(spec)
                await self._attach(vm)
                await self._restore(vm, groups, tpl)
            else:
                await asyncio.to_thread(self._make_disk, vm)
                await self._attach(vm)
                await self._boot(vm, groups)
            await self._configure_guest(vm)
            if spec.warm:     # a fresh QEMU translates the guest's code anew (TCG): a pool's VM pays it here
                code, _, err = await self._shell(vm, WARM_UP, [], b"")
                if code:
                    raise BackendError(f"sandbox {spec.id}: its warm-up failed ({code}): {err[-200:]!r}")
            vm.watch = asyncio.ensure_future(vm.proc.wait())
            vm.watch.add_done_callback(lambda done: done.cancelled() or self._exited(vm))
        except BaseException as exc:
            vm.dying = asyncio.get_running_loop().create_future()
            try:
                await self._teardown(vm)
            finally:
                self._vms.pop(spec.id, None)
            failure = boot_failure(exc, f"sandbox {spec.id}", self._dir(spec.id) / "console.log")
            if failure is not None:
                raise failure from exc
            raise

    async def _probe_kvm(self) -> bool:
        """Whether the guest boots to its agent under KVM within accel.PROBE_TIMEOUT (a PVM host's
        /dev/kvm opens, and hangs the boot)."""
        vm = VM(SandboxSpec("probe.kvm", self._probe_layers(), Limits(memory=kinds.MIN_MEMORY[self.kind],
                                                                        disk=16 << 20), kind=self.kind),
                 idmap.IdRange(-1))
        self.accel = "kvm"
        try:
            vm.ids = self._ids.lease(vm.key)
            await asyncio.to_thread(self._make_disk, vm)
            await self._boot(vm, self._cgroups.create_sandbox(vm.key, self._host_limits(vm.spec.limits)),
                             timeout=accel.PROBE_TIMEOUT)
            return True
        except (BackendError, asyncio.TimeoutError, OSError, CgroupError):
            return False
        finally:
            self.accel = "tcg"
            vm.dying = asyncio.get_running_loop().create_future()
            residue = await self._teardown(vm)
            if residue:
                raise BackendError(f"the KVM probe left: {'; '.join(residue)}")

    async def destroy(self, sandbox_id: str) -> None:
        vm = self._vms.get(sandbox_id)
        if vm is None:
            raise SandboxGone(f"no such sandbox: {sandbox_id}")
        if vm.dying is None:
            vm.dying = asyncio.ensure_future(self._destroy(vm))
        await asyncio.shield(vm.dying)

    async def _destroy(self, vm: VM) -> None:
        try:
            residue = await self._teardown(vm)
        finally:
            if self._vms.get(vm.spec.id) is vm:
                self._vms.pop(vm.spec.id)
        if residue:
            raise BackendError(f"destroy {vm.spec.id} left: {'; '.join(residue)}")

    async def _teardown(self, vm: VM) -> list[str]:
        """Kill QEMU (its whole freezer group), remove its groups and dir; what could not be removed."""
        residue: list[str] = []
        groups = self._cgroups.sandbox(vm.key)
        try:
            if vm.watch is not None:
                vm.watch.cancel()
            if vm.chan is not None:
                vm.chan.close()
            if vm.qmp is not None:
                vm.qmp.close()
            if vm.proc is not None and vm.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    vm.proc.kill()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(vm.proc.wait(), 10)
            if groups["freezer"].exists() and not await cgroups.kill_tree(groups["freezer"]):
                residue.append(f"processes survive in {groups['freezer']}")
            residue.extend(await _remove_groups(groups))
            await self._detach(vm)
            with contextlib.suppress(OSError):
                remove_path(self._dir(vm.key))
            if self._dir(vm.key).exists():
                residue.append(f"VM dir {self._dir(vm.key)}")
        finally:
            if vm.ids.index >= 0 and not residue:
                self._ids.release(vm.ids)
        return residue

    async def claim(self, warm_id: str, spec: SandboxSpec) -> None:
        """Give a warm VM (restored, its first command already run) spec's id, hostname and env."""
        vm = self._live(warm_id)
        if spec.id in self._vms or not valid_id(spec.id):
            raise BackendError(f"sandbox already exists or invalid id: {spec.id!r}")
        await vm.chan.set_hostname(spec.id)
        self._vms[spec.id] = self._vms.pop(warm_id)
        vm.spec = spec
        vm.chan.sandbox_id = spec.id
        self._claimed[spec.id] = vm.key
        while len(self._claimed) > CLAIMED_KEPT:
            self._claimed.pop(next(iter(self._claimed)))

    # ------------------------------------------------------------ freeze

    async def freeze(self, sandbox_id: str) -> None:
        """Stop the vCPUs (the RAM stays)."""
        vm = self._live(sandbox_id)
        if vm.frozen_since is None:
            await vm.qmp.execute("stop")
            vm.frozen_since = time.monotonic()

    async def thaw(self, sandbox_id: str) -> None:
        vm = self._live(sandbox_id)
        if vm.frozen_since is not None:
            await vm.qmp.execute("cont")
            vm.frozen_total += time.monotonic() - vm.frozen_since
            vm.frozen_since = None

    async def pack_upper(self, sandbox_id: str, dst: str) -> str:
        """The writable layer frozen in the guest, streamed out as a tar, unpacked as untrusted input and
        packed with mkfs.erofs (microvm/snapshot.py). A suspended VM runs its vCPUs for the pack (its
        writers wait on the frozen filesystem) and is stopped again after."""
        vm = self._live(sandbox_id)
        async with vm.packing:
            suspended = vm.frozen_since is not None
            if suspended:
                await vm.qmp.execute("cont")
            work = Path(tempfile.mkdtemp(prefix="pack-", dir=self._dir(vm.key)))
            try:
                return await snapshot.pack(vm.chan, sandbox_id, vm.spec.limits.disk, DEFAULT_ENV, work, Path(dst))
            finally:
                with contextlib.suppress(OSError):   # (the guest's tree, of any depth)
                    await asyncio.to_thread(remove_path, work)
                if suspended and vm.dying is None:
                    await vm.qmp.execute("stop")

    def _live(self, sandbox_id: str) -> VM:
        vm = self._vms.get(sandbox_id)
        if vm is None or vm.dying is not None or vm.chan is None:
            raise SandboxGone(f"no such sandbox: {sandbox_id}")
        if vm.chan.closed.done():
            raise BackendError(f"sandbox {sandbox_id} is not running ({vm.chan.closed.result()}); destroy it")
        return vm

    # ------------------------------------------------------------ work

    async def exec(self, sandbox_id: str, argv: list[str], *, env: dict[str, str], cwd: str,
                   stdin: bytes | None, timeout: float, sink: OutputSink,
                   control: ExecControl | None = None, user=None, pty: tuple[int, int] | None = None) -> ExecResult:
        """Run argv through the guest's agent, as user (users.ExecUser; None: the guest's root), on a terminal
        of pty's (rows, cols) if given."""
        vm = self._live(sandbox_id)
        if not argv:
            raise BackendError("empty command")
        try:
            return await vm.chan.exec(list(argv), {**DEFAULT_ENV, **vm.spec.env, **env}, cwd or "/", stdin,
                                      timeout, sink, control, vm.frozen_for, user=user, pty=pty)
        except SandboxGone:
            if vm.dying is None and vm.watch is not None:   # the agent's EOF comes first, QEMU's exit just
                await asyncio.wait({vm.watch}, timeout=5)   # after: told to the edge (died) before we answer
            raise

    async def _shell(self, vm: VM, script: str, args: list[str], stdin: bytes | None,
                     timeout: float = 60.0) -> tuple[int, bytes, bytes]:
        out = {"stdout": bytearray(), "stderr": bytearray()}

        async def sink(stream, data: bytes) -> None:
            out[stream] += data
        res = await vm.chan.exec([TRUSTED_BUSYBOX, "sh", "-c", script, "sh", *args], DEFAULT_ENV, "/", stdin,
                                 timeout, sink,
                                 None, vm.frozen_for)
        return res.exit_code, bytes(out["stdout"]), bytes(out["stderr"])

    # ------------------------------------------------------------ checks

    def residue(self, sandbox_id: str) -> list[str]:
        out: list[str] = []
        vm = self._vms.get(sandbox_id)
        sandbox_id = vm.key if vm is not None else self._claimed.get(sandbox_id, sandbox_id)
        for path in self._cgroups.sandbox(sandbox_id).values():
            if path.exists():
                out.append(f"cgroup {path}")
                out.extend(f"process {pid} in {path}" for pid in cgroups.procs_under(path))
        if self._dir(sandbox_id).exists():
            out.append(f"VM dir {self._dir(sandbox_id)}")
        out.extend(f"qemu process {pid}" for pid in qemu_processes(self.state_dir, sandbox_id))
        return out

    def leftovers(self) -> list[str]:
        out = list(NodeCgroups(self.label).describe())
        vms = self.state_dir / "vms"
        out.extend(f"VM dir {vms / d}" for d in (os.listdir(vms) if vms.is_dir() else []))
        out.extend(f"uid range lease {i} ({key})" for i, key in self._ids.held().items() if key != idmap.DRAINING)
        out.extend(f"qemu process {pid}" for pid in qemu_processes(self.state_dir))
        out.extend(f"template {key}" for key in self._templates.held())
        out.extend(f"memory snapshot {name}" for name in self.memories())
        for root in (self._templates.root, self._memory_root):
            if root.exists():
                out.append(f"{root.name} dir {root}")
        return out


WARM_UP = f"{TRUSTED_SHELL} -c : && read -r _ < /proc/self/stat"   # fork, exec of the trusted shell, a file read


def _qemu_version(binary: str) -> str:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.splitlines()[0] if out else "unknown"


def leftovers(state_dir: Path, node_id: str) -> list[str]:
    """Everything a microvm node (its state in state_dir) left on the host, without starting one."""
    return MicroVMBackend(state_dir, node_id).leftovers()

