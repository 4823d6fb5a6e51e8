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
- has no network device (`-nodefaults`, no `-netdev`), no display, no reboot.
The guest's pid 1 is dsec-agent, which speaks the same framed channel as in a gVisor sandbox
(gvisor/agent.py) over a virtio-serial port whose host end is one end of a socketpair; QEMU's monitor
(QMP) is a second socketpair, used for suspend (stop/cont). Files are read and written by the trusted
shell inside the guest, so paths resolve in the guest's root and nowhere else.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bus import kinds
from edge.backends import cgroups, idmap
from edge.backends.base import (Backend, BackendError, ExecControl, ExecResult, Limits, OutputSink, SandboxGone,
                                SandboxSpec, TRUSTED_SHELL)
from edge.backends.cgroups import CgroupError, NodeCgroups
from edge.backends.gvisor.agent import AgentChannel
from edge.backends.gvisor.host import _join, _remove_groups, valid_id
from edge.backends.microvm import accel, guest, qemu, snapshot, template
from edge.backends.microvm.qemu import cpus, disk_size, log_tail, qemu_processes
from edge.backends.microvm.qmp import Qmp, QmpError
from edge.backends.rootfiles import file_error

__all__ = ["MicroVMBackend", "leftovers"]

DEFAULT_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root"}
READY_TIMEOUT = float(os.environ.get("DSEC_VM_READY_TIMEOUT", "90"))   # a cold boot under TCG on a busy node
IGNORE_SHARED = [{"capability": "x-ignore-shared", "state": True}]   # a template's RAM stays out of its state
CLAIMED_KEPT = 4096         # claimed ids remembered for residue() after their destroy
HOST_TASKS = 512            # QEMU's threads: a backstop only, the guest's pids limit is the guest's own


@dataclass
class _VM:
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

    def __post_init__(self) -> None:
        self.key = self.key or self.spec.id

    def frozen_for(self) -> float:
        return self.frozen_total + (time.monotonic() - self.frozen_since if self.frozen_since is not None else 0.0)


class MicroVMBackend(Backend):
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
        self._vms: dict[str, _VM] = {}
        self._guest: guest.Guest | None = None
        self.use_templates = templates
        self._claimed: dict[str, str] = {}     # id -> key of sandboxes claimed from a warm pool (for residue())
        self._templates = template.Templates(self.state_dir / "templates")

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
        problems = await self._cgroups.reconcile()
        for pid in qemu_processes(self.state_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.state_dir / "vms", ignore_errors=True)
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
        vm = self._vms[spec.id] = _VM(spec, idmap.IdRange(-1))
        try:
            vm.ids = self._ids.lease(vm.key)
            groups = self._cgroups.create_sandbox(vm.key, self._host_limits(spec.limits))
            if self.use_templates:
                await self._restore(vm, groups, await self._template(spec))
            else:
                await asyncio.to_thread(self._make_disk, vm)
                await self._boot(vm, groups)
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
            if isinstance(exc, (CgroupError, OSError, QmpError)):
                raise BackendError(f"sandbox {spec.id}: {exc}") from exc
            if isinstance(exc, asyncio.TimeoutError):
                raise BackendError(f"sandbox {spec.id}: the VM did not boot within {READY_TIMEOUT:.0f}s "
                                   f"({log_tail(self._dir(spec.id) / 'console.log')})") from exc
            raise

    async def _probe_kvm(self) -> bool:
        """Whether the guest boots to its agent under KVM within accel.PROBE_TIMEOUT (a PVM host's
        /dev/kvm opens, and hangs the boot)."""
        vm = _VM(SandboxSpec("probe.kvm", self._probe_layers(), Limits(memory=kinds.MIN_MEMORY[self.kind],
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

    # ------------------------------------------------------------ templates

    async def _template(self, spec: SandboxSpec) -> template.Template:
        limits = spec.limits
        key = template.key_of(self._guest, self.accel, limits.memory, cpus(limits), disk_size(limits), limits.pids,
                              len(spec.layers), spec.privileged, layers=list(spec.layers))
        return await self._templates.get(key, lambda path: self._build_template(path, spec))

    async def _build_template(self, path: Path, spec: SandboxSpec) -> tuple[int, int]:
        """Boot a VM of spec's layers and size with its RAM in a memfd, save its device state into path,
        keep its disk as it was then; return the (sealed) memfd."""
        vm = _VM(dataclasses.replace(spec, id=f"template.{path.name}", env={}), idmap.IdRange(-1))
        ram = template.new_ram(spec.limits.memory)
        try:
            vm.ids = self._ids.lease(vm.key)
            await asyncio.to_thread(self._make_disk, vm)
            await self._boot(vm, self._cgroups.create_sandbox(vm.key, self._host_limits(spec.limits)), ram=ram)
            await self._settle(vm)
            state = os.open(path / "state", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                await vm.qmp.execute("getfd", fd=state, fdname="template")
            finally:
                os.close(state)
            await vm.qmp.execute("migrate-set-capabilities", capabilities=IGNORE_SHARED)
            await vm.qmp.execute("migrate", uri="fd:template")
            deadline = time.monotonic() + READY_TIMEOUT
            while (st := await vm.qmp.execute("query-migrate")).get("status") != "completed":
                if st.get("status") in ("failed", "cancelled") or time.monotonic() > deadline:
                    raise BackendError(f"saving the template failed: {st.get('error-desc', st.get('status'))}")
                await asyncio.sleep(0.01)
            vm.proc.kill()
            await vm.proc.wait()
            os.rename(self._dir(vm.key) / "disk.img", path / "disk.img")
            template.seal(ram)
        except BaseException as exc:
            os.close(ram)
            if isinstance(exc, (OSError, CgroupError, QmpError)):
                raise BackendError(f"building the template failed: {exc}") from exc
            if isinstance(exc, asyncio.TimeoutError):
                raise BackendError(f"the template VM did not boot within {READY_TIMEOUT:.0f}s "
                                   f"({log_tail(self._dir(vm.key) / 'console.log')})") from exc
            raise
        finally:
            vm.dying = asyncio.get_running_loop().create_future()
            residue = await self._teardown(vm)
            if residue:
                raise BackendError(f"the template VM left: {'; '.join(residue)}")
        return ram, spec.limits.memory

    async def _restore(self, vm: _VM, groups: dict[str, Path], tpl: template.Template) -> None:
        """Start the VM from tpl: its own copy of the template's disk, the template's RAM copy-on-write."""
        work = self._dir(vm.key)
        await asyncio.to_thread(work.mkdir, 0o700)
        await asyncio.to_thread(template.copy_sparse, tpl.disk, work / "disk.img")
        state = os.open(tpl.state, os.O_RDONLY | os.O_CLOEXEC)
        try:
            exited = await self._spawn(vm, groups, ram=tpl.ram, incoming=state)
        except BaseException:
            os.close(state)
            raise
        try:
            await vm.qmp.execute("migrate-set-capabilities", capabilities=IGNORE_SHARED)
            await vm.qmp.execute("migrate-incoming", uri=f"fd:{state}")
            vm.chan.ready.add_done_callback(lambda f: f.cancelled() or f.exception())   # wake() reports it
            wake = asyncio.ensure_future(vm.chan.wake(vm.spec.id, READY_TIMEOUT))
            await asyncio.wait({wake, exited}, return_when=asyncio.FIRST_COMPLETED)
            if not wake.done() or wake.exception() is not None:
                if not exited.done():    # the agent is gone: QEMU is on its way out (or wedged)
                    await asyncio.wait({exited}, timeout=5)
                wake.cancel()
                with contextlib.suppress(BaseException):
                    await wake
                if exited.done():
                    self._templates.drop(tpl.key)     # a template that does not restore is built again
                    raise BackendError(f"sandbox {vm.spec.id}: the VM stopped while restoring from its template "
                                       f"(QEMU exit {vm.proc.returncode}): {log_tail(work / 'qemu.log')}")
                wake.result()
        finally:
            os.close(state)
            if not exited.done():
                exited.cancel()

    # ------------------------------------------------------------ boot

    def _make_disk(self, vm: _VM) -> None:
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

    def _argv(self, vm: _VM, fds: dict[str, int], agent: int, monitor: int, console: int,
              ram: int | None, incoming: int | None) -> list[str]:
        return qemu.argv(self.qemu, self.accel, self._guest, vm.spec, self._dir(vm.key), fds,
                         agent=agent, monitor=monitor, console=console, ram=ram, incoming=incoming,
                         machine=self.machine)

    async def _settle(self, vm: _VM) -> None:
        """Wait, before a template is saved, until its booted guest is at rest (a microVM is once its agent
        answered)."""

    def _probe_layers(self) -> list[str]:
        """The layers the KVM probe boots (a microVM: none)."""
        return []

    def _host_limits(self, limits: Limits) -> Limits:
        """The QEMU process's host groups: the VM's memory plus QEMU's own, its cpu, a backstop on threads."""
        return Limits(cpu=limits.cpu, memory=limits.memory + kinds.OVERHEAD[self.kind][0], pids=HOST_TASKS,
                      disk=limits.disk)

    async def _boot(self, vm: _VM, groups: dict[str, Path], ram: int | None = None,
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

    async def _spawn(self, vm: _VM, groups: dict[str, Path], *, ram: int | None = None,
                     incoming: int | None = None) -> asyncio.Future:
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

            hide = [self.state_dir, *{Path(p).parent for p in vm.spec.layers}, Path("/dev/shm"), Path("/run/dsec")]
            kvm = self.accel == "kvm"

            def become() -> None:
                _join(tasks)
                qemu.confine(uid, hide, self._guest.kernel, kvm)
            argv = self._argv(vm, fds, guest_a.fileno(), guest_m.fileno(), console, ram, incoming)
            extra = [fd for fd in (ram, incoming) if fd is not None]
            try:
                vm.proc = await asyncio.create_subprocess_exec(
                    *argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                    pass_fds=[*fds.values(), console, guest_a.fileno(), guest_m.fileno(), *extra], preexec_fn=become)
            except subprocess.SubprocessError as exc:    # confine() failed in the child
                raise BackendError(f"sandbox {vm.spec.id}: QEMU could not be confined: {exc}") from exc
        finally:
            for fd in (*fds.values(), log, console):
                os.close(fd)
            guest_a.close()
            guest_m.close()
        vm.qmp = Qmp(host_m)
        r = host_a.detach()
        vm.chan = AgentChannel(vm.spec.id, os.dup(r), r)
        return asyncio.ensure_future(vm.proc.wait())

    def _exited(self, vm: _VM) -> None:
        """QEMU ended while nobody destroyed its VM (the guest crashed, powered off or was killed): told to
        the edge, which destroys the sandbox as failed."""
        if vm.dying is None and self._vms.get(vm.spec.id) is vm and self.died is not None:
            self.died(vm.spec.id, f"its VM exited (QEMU status {vm.proc.returncode}: "
                                  f"{log_tail(self._dir(vm.key) / 'console.log')})")

    async def destroy(self, sandbox_id: str) -> None:
        vm = self._vms.get(sandbox_id)
        if vm is None:
            raise SandboxGone(f"no such sandbox: {sandbox_id}")
        if vm.dying is None:
            vm.dying = asyncio.ensure_future(self._destroy(vm))
        await asyncio.shield(vm.dying)

    async def _destroy(self, vm: _VM) -> None:
        try:
            residue = await self._teardown(vm)
        finally:
            if self._vms.get(vm.spec.id) is vm:
                self._vms.pop(vm.spec.id)
        if residue:
            raise BackendError(f"destroy {vm.spec.id} left: {'; '.join(residue)}")

    async def _teardown(self, vm: _VM) -> list[str]:
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
            shutil.rmtree(self._dir(vm.key), ignore_errors=True)
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
                await asyncio.to_thread(shutil.rmtree, work, True)
                if suspended and vm.dying is None:
                    await vm.qmp.execute("stop")

    def _live(self, sandbox_id: str) -> _VM:
        vm = self._vms.get(sandbox_id)
        if vm is None or vm.dying is not None or vm.chan is None:
            raise SandboxGone(f"no such sandbox: {sandbox_id}")
        if vm.chan.closed.done():
            raise BackendError(f"sandbox {sandbox_id} is not running ({vm.chan.closed.result()}); destroy it")
        return vm

    # ------------------------------------------------------------ work

    async def exec(self, sandbox_id: str, argv: list[str], *, env: dict[str, str], cwd: str,
                   stdin: bytes | None, timeout: float, sink: OutputSink,
                   control: ExecControl | None = None) -> ExecResult:
        vm = self._live(sandbox_id)
        if not argv:
            raise BackendError("empty command")
        try:
            return await vm.chan.exec(list(argv), {**DEFAULT_ENV, **vm.spec.env, **env}, cwd or "/", stdin,
                                      timeout, sink, control, vm.frozen_for)
        except SandboxGone:
            if vm.dying is None and vm.watch is not None:   # the agent's EOF comes first, QEMU's exit just
                await asyncio.wait({vm.watch}, timeout=5)   # after: told to the edge (died) before we answer
            raise

    async def _shell(self, vm: _VM, script: str, args: list[str], stdin: bytes | None,
                     timeout: float = 60.0) -> tuple[int, bytes, bytes]:
        out = {"stdout": bytearray(), "stderr": bytearray()}

        async def sink(stream, data: bytes) -> None:
            out[stream] += data
        res = await vm.chan.exec([TRUSTED_SHELL, "-c", script, "sh", *args], DEFAULT_ENV, "/", stdin, timeout, sink,
                                 None, vm.frozen_for)
        return res.exit_code, bytes(out["stdout"]), bytes(out["stderr"])

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None:
        """Create or truncate a file inside the guest (its own root: nothing of the host is reachable)."""
        vm = self._live(sandbox_id)
        code, _, err = await self._shell(vm, _WRITE, [path, f"{mode & 0o7777:o}"], data)
        if code:
            raise file_error(OSError(code, err.decode(errors="replace").strip() or os.strerror(code)), path, True)

    async def read_file(self, sandbox_id: str, path: str, limit: int) -> bytes:
        vm = self._live(sandbox_id)
        code, out, err = await self._shell(vm, _READ, [path, str(limit)], b"")
        if code:
            raise file_error(OSError(code, err.decode(errors="replace").strip() or os.strerror(code)), path, False)
        return out

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
        if self._templates.root.exists():
            out.append(f"templates dir {self._templates.root}")
        return out


WARM_UP = f"{TRUSTED_SHELL} -c : && cat /proc/self/stat >/dev/null"   # fork, exec, a file read
# Exit codes are errnos, so file_error words them as for containers.
_WRITE = (f'p=$1; [ -d "$p" ] && exit {errno.EISDIR}; d=${{p%/*}}; [ -z "$d" ] || [ -d "$d" ] || exit {errno.ENOENT}; '
          f'cat > "$p" 2>/dev/null || exit {errno.EACCES}; chmod "$2" "$p"')
_READ = (f'[ -e "$1" ] || exit {errno.ENOENT}; [ -d "$1" ] && exit {errno.EISDIR}; '
         f'[ -r "$1" ] || exit {errno.EACCES}; head -c "$2" "$1"')


def _qemu_version(binary: str) -> str:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.splitlines()[0] if out else "unknown"


def leftovers(state_dir: Path, node_id: str) -> list[str]:
    """Everything a microvm node (its state in state_dir) left on the host, without starting one."""
    return MicroVMBackend(state_dir, node_id).leftovers()

