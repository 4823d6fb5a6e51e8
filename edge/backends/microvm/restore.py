"""Templates of a microVM kind: built once per key by booting a VM and saving it, restored by every create
of the key (template.py says what a template is)."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from pathlib import Path

from edge.backends import idmap
from edge.backends.base import BackendError, SandboxSpec
from edge.backends.microvm import template
from edge.backends.microvm.qemu import cpus, disk_size, log_tail
from edge.backends.microvm.qmp import QmpError
from edge.backends.microvm.boot import boot_failure
from edge.backends.microvm.vm import IGNORE_SHARED, READY_TIMEOUT, VM

MIGRATE_TIMEOUT = 120.0


class Restoring:
    """MicroVMBackend's templates (a mixin: it uses the backend's QEMU spawning and teardown), and the
    migration to and from a file that templates and memory snapshots (memory.py) are made of."""

    async def _template(self, spec: SandboxSpec) -> template.Template:
        limits = spec.limits
        key = template.key_of(self._guest, self.accel, limits.memory, cpus(limits), disk_size(limits), limits.pids,
                              len(spec.layers), spec.privileged, self._pmem(spec), layers=list(spec.layers))
        return await self._templates.get(key, lambda path: self._build_template(path, spec))

    async def _build_template(self, path: Path, spec: SandboxSpec) -> tuple[int, int]:
        """Boot a VM of spec's layers and size with its RAM in a memfd, save its device state into path,
        keep its disk as it was then; return the (sealed) memfd."""
        vm = VM(dataclasses.replace(spec, id=f"template.{path.name}", env={}), idmap.IdRange(-1))
        ram = template.new_ram(spec.limits.memory)
        try:
            vm.ids = self._ids.lease(vm.key)
            await asyncio.to_thread(self._make_disk, vm)
            await self._boot(vm, self._cgroups.create_sandbox(vm.key, self._host_limits(spec.limits)), ram=ram)
            await self._settle(vm)
            await self._migrate(vm, path / "state", shared=True)
            vm.proc.kill()
            await vm.proc.wait()
            os.rename(self._dir(vm.key) / "disk.img", path / "disk.img")
            template.seal(ram)
        except BaseException as exc:
            os.close(ram)
            failure = boot_failure(exc, "building the template failed", self._dir(vm.key) / "console.log")
            if failure is not None:
                raise failure from exc
            raise
        finally:
            vm.dying = asyncio.get_running_loop().create_future()
            residue = await self._teardown(vm)
            if residue:
                raise BackendError(f"the template VM left: {'; '.join(residue)}")
        return ram, spec.limits.memory

    async def _restore(self, vm: VM, groups: dict[str, Path], tpl: template.Template, fork: bool = False) -> None:
        """Start the VM from tpl: its own copy of the template's disk, the template's RAM copy-on-write.
        fork: tpl is a memory snapshot (memory.py), whose agent lets its source's execs go."""
        work = self._dir(vm.key)
        await asyncio.to_thread(work.mkdir, 0o700)
        await asyncio.to_thread(template.copy_sparse, tpl.disk, work / "disk.img")
        state = os.open(tpl.state, os.O_RDONLY | os.O_CLOEXEC)
        try:
            exited = await self._spawn(vm, groups, ram=tpl.ram, incoming=state)
        except BaseException:
            os.close(state)
            raise
        wake = None
        try:
            await vm.qmp.execute("migrate-set-capabilities", capabilities=IGNORE_SHARED)
            await vm.qmp.execute("migrate-incoming", uri=f"fd:{state}")
            if fork:    # saved stopped, so it loads stopped: it runs once loaded
                await self._migrated(vm, "restoring the memory snapshot", exited)
                await vm.qmp.execute("cont")
            vm.chan.ready.add_done_callback(lambda f: f.cancelled() or f.exception())   # wake() reports it
            wake = asyncio.ensure_future(vm.chan.wake(vm.spec.id, READY_TIMEOUT))
            wake.add_done_callback(lambda f: f.cancelled() or f.exception())   # (a restore cancelled meanwhile)
            await asyncio.wait({wake, exited}, return_when=asyncio.FIRST_COMPLETED)
            if not wake.done() or wake.exception() is not None:
                if not exited.done():    # the agent is gone: QEMU is on its way out (or wedged)
                    await asyncio.wait({exited}, timeout=5)
                wake.cancel()
                with contextlib.suppress(BaseException):
                    await wake
                if exited.done():
                    if not fork:
                        self._templates.drop(tpl.key)     # a template that does not restore is built again
                    raise BackendError(f"sandbox {vm.spec.id}: the VM stopped while restoring from its template "
                                       f"(QEMU exit {vm.proc.returncode}): {log_tail(work / 'qemu.log')}")
                wake.result()
            if fork:
                await vm.chan.release(detach=True)
        finally:
            os.close(state)
            if not exited.done():
                exited.cancel()
            if wake is not None and not wake.done():
                wake.cancel()

    async def _migrate(self, vm: VM, dst: Path, *, shared: bool) -> None:
        """Migrate a stopped VM's state into the new file dst: RAM included unless shared (then a memfd RAM
        shared with QEMU stays out, x-ignore-shared)."""
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            await vm.qmp.execute("getfd", fd=fd, fdname="save")
        finally:
            os.close(fd)
        await vm.qmp.execute("migrate-set-capabilities",
                             capabilities=[{"capability": "x-ignore-shared", "state": shared}])
        await vm.qmp.execute("migrate", uri="fd:save")
        await self._migrated(vm, "saving the VM's state")

    async def _migrated(self, vm: VM, what: str, exited: asyncio.Future | None = None) -> None:
        """Until query-migrate says completed (either end); BackendError if it failed or took too long."""
        deadline = time.monotonic() + MIGRATE_TIMEOUT
        while (st := await self._query_migrate(vm, what)).get("status") != "completed":
            if st.get("status") in ("failed", "cancelled") or time.monotonic() > deadline \
                    or (exited is not None and exited.done()):
                raise BackendError(f"{what} failed: {st.get('error-desc', st.get('status'))} "
                                   f"({log_tail(self._dir(vm.key) / 'qemu.log')})")
            await asyncio.sleep(0.01)

    async def _query_migrate(self, vm: VM, what: str) -> dict:
        """query-migrate; a QEMU gone meanwhile (it ends when a load fails) says why, from its log."""
        try:
            return await vm.qmp.execute("query-migrate")
        except QmpError as exc:
            await asyncio.sleep(0.1)     # (its last words reach the log as it exits)
            raise BackendError(f"{what} failed: {exc} ({log_tail(self._dir(vm.key) / 'qemu.log')})") from exc
