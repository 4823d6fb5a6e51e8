"""Memory snapshots of a VM (sb.snapshot(memory=True)): its RAM, device state and disk at one instant, from
which forks go on with every process where it was.

Saving one (save_memory), with the VM's vCPUs stopped for the time it takes (~0.2-0.5 s for 256 MiB):
1. its agent goes quiet and the edge holds its frames (AgentChannel.quiesce), so the saved channel is
   between frames both ways;
2. QEMU migrates the whole VM, RAM included, into a file, and the VM's disk is copied (sparse) while its
   block devices are inactive; then the VM goes on (or stays stopped, if it was suspended) and its agent
   speaks again, the held frames after it;
3. a loader QEMU that never runs (-S) reads that stream into a fresh memfd shared with it, and saves its
   device state without RAM; its memfd is sealed. The snapshot is then a template (template.py): each fork
   restores from it, its RAM copy-on-write, its own copy of the disk, the wake of a template (clock, RNG
   reseed, hostname; no sibling shares RNG state), and its agent lets the source's execs go (their
   processes run on, their output is dropped, new execs are numbered above theirs).
The source's layer files are held open by fd, so a fork restores after the layer cache dropped them.

Like templates, memory snapshots live in memfds on their node: they fork only there (placement pins the
create), and die with the edge (a create then fails ImageNotFound; its files stay usable through the
snapshot's layers). A node holds at most DSEC_VM_MEMORY_SNAPSHOTS of them; the edge drops those whose
snapshot record was deleted (edge/sandboxes.py, prune_memories).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from edge.backends import idmap
from edge.backends.base import BackendError, CapacityExhausted, SandboxSpec, SpecRefused
from edge.backends.cgroups import CgroupError
from edge.backends.microvm import template
from edge.backends.microvm.qmp import QmpError
from edge.backends.microvm.vm import VM

KEEP = int(os.environ.get("DSEC_VM_MEMORY_SNAPSHOTS", "8"))   # memory snapshots a node holds at most


@dataclass
class MemoryImage:
    tpl: template.Template
    spec: SandboxSpec                      # the source's: its limits, layers (their paths then), privileged
    layers: list[int] = field(default_factory=list)   # its layer files, held open

    def close(self) -> None:
        for fd in self.layers:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.layers = []


def fork_spec(image: MemoryImage, spec: SandboxSpec) -> SandboxSpec:
    """What a fork of image boots: the create's id and env, the source's size, layers (by held fd) and
    privilege (the device state fixes them); SpecRefused when the create asked another privilege."""
    if spec.privileged != image.spec.privileged:
        raise SpecRefused(f"snapshot {image.tpl.key}'s memory is of a {'' if image.spec.privileged else 'non-'}privileged "
                          f"VM: it forks only as one (privileged={image.spec.privileged})")
    return dataclasses.replace(spec, limits=image.spec.limits, privileged=image.spec.privileged,
                               layers=[f"/proc/self/fd/{fd}" for fd in image.layers])


class MemorySnapshots:
    """MicroVMBackend's memory snapshots (a mixin: it uses the backend's VMs, QEMU spawning and teardown)."""

    def _memory_init(self) -> None:
        self._memory: dict[str, MemoryImage] = {}
        self._memory_root = self.state_dir / "memory"

    def memories(self) -> list[str]:
        return sorted(self._memory)

    def drop_memory(self, name: str) -> None:
        image = self._memory.pop(name, None)
        if image is not None:
            image.close()
            with contextlib.suppress(OSError):
                os.close(image.tpl.ram)
            shutil.rmtree(image.tpl.dir, ignore_errors=True)

    def _memory_clear(self) -> None:
        for name in list(self._memory):
            self.drop_memory(name)
        shutil.rmtree(self._memory_root, ignore_errors=True)

    def memory_image(self, name: str) -> MemoryImage:
        image = self._memory.get(name)
        if image is None:
            raise BackendError(f"the memory of snapshot {name} is not held on this node (its edge restarted "
                               f"since it was taken, or it was deleted)")
        return image

    async def save_memory(self, sandbox_id: str, name: str) -> int:
        vm = self._live(sandbox_id)
        if name in self._memory:
            raise BackendError(f"memory snapshot {name} exists already")
        if len(self._memory) >= KEEP:
            raise CapacityExhausted(f"this node holds {KEEP} memory snapshots already (DSEC_VM_MEMORY_SNAPSHOTS): "
                                    f"delete some first")
        path = self._memory_root / name
        async with vm.packing:
            await asyncio.to_thread(path.mkdir, 0o700, True)
            layers: list[int] = []
            try:
                layers = [os.open(p, os.O_RDONLY | os.O_CLOEXEC) for p in vm.spec.layers]
                loader = await self._save_running(vm, path)
                ram = await self._load(loader, path)
            except BaseException as exc:
                for fd in layers:
                    os.close(fd)
                shutil.rmtree(path, ignore_errors=True)
                if isinstance(exc, (OSError, CgroupError, QmpError)):
                    raise BackendError(f"memory snapshot of {sandbox_id} failed: {exc}") from exc
                raise
        tpl = template.Template(name, path, ram, vm.spec.limits.memory)
        self._memory[name] = MemoryImage(tpl, vm.spec, layers)
        return tpl.size

    async def _save_running(self, vm, path: Path):
        """Steps 1-2: the VM's whole state into path/stream, its disk into a loader VM's dir; the loader."""
        suspended = vm.frozen_since is not None
        if suspended:
            await vm.qmp.execute("cont")
        else:
            vm.frozen_since = time.monotonic()     # its commands' timeouts wait while it is stopped
        loader = None
        try:
            await vm.chan.quiesce()
            try:
                await vm.qmp.execute("stop")
                await self._migrate(vm, path / "stream", shared=False)
                loader = self._loader(vm.spec, path.name)
                work = self._dir(loader.key)
                await asyncio.to_thread(work.mkdir, 0o700)
                await asyncio.to_thread(template.copy_sparse, self._dir(vm.key) / "disk.img", work / "disk.img")
            finally:
                if vm.dying is None:
                    await vm.qmp.execute("cont")          # from postmigrate: its block devices come back
                    await vm.chan.release(detach=False)
        except BaseException:
            if loader is not None:
                await self._end_loader(loader)
            raise
        finally:
            if suspended and vm.dying is None:
                await vm.qmp.execute("stop")
            elif not suspended:
                vm.frozen_total += time.monotonic() - vm.frozen_since
                vm.frozen_since = None
        return loader

    def _loader(self, spec: SandboxSpec, name: str):
        return VM(dataclasses.replace(spec, id=f"memory.{name}", env={}), idmap.IdRange(-1))

    async def _load(self, loader, path: Path) -> int:
        """Step 3: the stream into a memfd by a QEMU that never runs, its device state saved without RAM."""
        ram = template.new_ram(loader.spec.limits.memory)
        try:
            loader.ids = self._ids.lease(loader.key)
            limits = self._host_limits(loader.spec.limits)    # (plus the pmem layers it holds: qemu.argv)
            pmem = sum(os.stat(p).st_size for p in loader.spec.layers[:self._pmem(loader.spec)])
            groups = self._cgroups.create_sandbox(loader.key, dataclasses.replace(limits, memory=limits.memory + pmem))
            stream = os.open(path / "stream", os.O_RDONLY | os.O_CLOEXEC)
            try:
                exited = await self._spawn(loader, groups, ram=ram, incoming=stream, load=True)
                loader.chan.ready.add_done_callback(lambda f: f.cancelled() or f.exception())   # it never runs
                try:
                    await loader.qmp.execute("migrate-incoming", uri=f"fd:{stream}")
                    await self._migrated(loader, "loading the memory snapshot", exited)
                finally:
                    exited.cancel()
            finally:
                os.close(stream)
            os.unlink(path / "stream")
            await self._migrate(loader, path / "state", shared=True)
            loader.proc.kill()
            await loader.proc.wait()
            os.rename(self._dir(loader.key) / "disk.img", path / "disk.img")
            template.seal(ram)
            return ram
        except BaseException:
            os.close(ram)
            raise
        finally:
            await self._end_loader(loader)

    async def _end_loader(self, loader) -> None:
        loader.dying = asyncio.get_running_loop().create_future()
        residue = await self._teardown(loader)
        if residue:
            raise BackendError(f"the memory snapshot's loader VM left: {'; '.join(residue)}")
