"""Lifecycle of the container backend: start (reconcile a crashed run first), stop, what is left."""
from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import shutil
from pathlib import Path

from edge.backends import cgroups, enter, hosttables, idmap, kernel, native, nodemounts, procviews, watcher, zygote
from edge.backends.base import BackendError, SandboxGone
from edge.backends.cgroups import NodeCgroups
from edge.backends.container.state import Core
from edge.backends.layermounts import IDLE_KEEP
from edge.backends.uppers import UpperError, loop_devices, mount_points, mounted_at
from edge.backends.zygote import LauncherError, Refresh

log = logging.getLogger(__name__)


class Lifecycle(Core):
    """start / stop / reconcile, and what tests and chaos ask about leaks."""

    async def start(self) -> None:
        """Reconcile a crashed run's leftovers, then prepare cgroups, the upper pool and the zygote."""
        self.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.state_dir, 0o700)   # an older, wider one is tightened: only root walks into it
        await self._reconcile()
        try:
            self._cgroups.setup()
            helper = await asyncio.to_thread(native.ensure_built)
            if not helper or not native.available():
                raise OSError(errno.ENOENT, "the dsec-enter helper cannot be built: install gcc and "
                                            "libc6-dev (make setup does)")
            self._spawner = enter.Spawner(helper, zygote.KEEP_MASK)
            await asyncio.to_thread(self._uppers.setup)
            self._io_device = self._uppers.device()
            await asyncio.to_thread(self._prepare_trusted)
            await asyncio.to_thread(nodemounts.prepare_devices, self._devices)
            await asyncio.to_thread(nodemounts.prepare_sysfs, self._sysfs)
            self._layers.root.mkdir(exist_ok=True)
            self._empty.mkdir(exist_ok=True)
            await self._launcher.start()
            await self._views.start()
            hosttables.favor_dynmods()
        except (OSError, UpperError, LauncherError) as exc:
            await self._reconcile()
            raise BackendError(f"container backend failed to start: {exc}") from exc

    async def _refresh_views(self) -> None:
        """lxcfs was started again: fresh /proc views into every running sandbox (through the zygote)."""
        hosttables.favor_dynmods()   # lxcfs mounted cgroup2 again, with its own flags
        views = self._views.proc_dir
        for sb in [sb for sb in self._sandboxes.values() if sb.dying is None and not sb.init_exit.done()]:
            try:
                _, done = await self._launcher.request(Refresh(init=sb.init_pid, views=views), [])
                status = await asyncio.wait_for(done, 10)
                if status != 0:
                    log.error("refreshing the /proc views of %s failed (status %s)", sb.spec.id, status)
            except (LauncherError, asyncio.TimeoutError) as exc:
                log.error("refreshing the /proc views of %s failed: %s", sb.spec.id, exc)

    def _prepare_trusted(self) -> None:
        """state_dir/trusted/{sh,busybox}: root-owned, read-only copies of the host's static shell and busybox
        (chronus/shell.py), on a small tmpfs of its own (bind-mounted into sandboxes, whose mountinfo then
        shows "/", not a host path)."""
        from edge.erofs import LayerBuildError, find_busybox, find_trusted_shell
        try:
            sources = {"sh": find_trusted_shell(), "busybox": find_busybox()}
        except LayerBuildError as exc:   # only a dynamic busybox (or none): no trusted shell
            raise OSError(f"no trusted shell: {exc}") from exc
        self._trusted.mkdir(mode=0o755, exist_ok=True)
        if not mounted_at(self._trusted):
            kernel.mount("tmpfs", self._trusted, "tmpfs", kernel.MS_NOSUID | kernel.MS_NODEV, "size=8m,mode=755")
        empty = self._trusted / zygote.TRUSTED_EMPTY   # masked dirs are read-only binds of it
        empty.mkdir(mode=0o555, exist_ok=True)
        for name, src in sources.items():
            tmp = self._trusted / f"{name}.tmp"
            shutil.copyfile(src, tmp)
            os.chmod(tmp, 0o555)
            os.replace(tmp, self._trusted / name)

    async def _reconcile(self) -> None:
        """Kill and remove everything this node id left under its cgroups and state dir; give back its
        uid ranges (those still holding keys stay leased, draining)."""
        problems = await self._cgroups.reconcile()
        await asyncio.to_thread(self._views.cleanup)
        if not problems:
            self._ids.setup()
            await asyncio.to_thread(self._ids.reclaim)
        self._layers.unmount_all()
        await asyncio.to_thread(self._uppers.teardown)
        for point in reversed(mount_points()):
            if point.startswith(f"{self.state_dir}/"):
                kernel.umount2(point, kernel.MNT_DETACH)
        for view in (self._packing.iterdir() if self._packing.is_dir() else []):   # a crash's packing views:
            with contextlib.suppress(OSError):                                   # empty once unmounted (rmdir,
                view.rmdir()                                                     # never a recursive removal)
        if problems:
            raise BackendError(f"cannot clean up node {self.node_id}: {'; '.join(problems)}")

    async def stop(self) -> None:
        """Destroy every sandbox, stop the zygote, unmount everything, remove the node cgroups."""
        results: list = []
        try:
            results = await asyncio.gather(*(self.destroy(i) for i in list(self._sandboxes)),
                                           return_exceptions=True)
        finally:   # cancelled (a stop budget ran out) or not: the node is left clean
            for task in list(self._drains):
                task.cancel()
            await self._views.stop()
            self._layers.unmount_all()
            try:
                await self._launcher.close()
            finally:
                if self._spawner is not None:
                    self._spawner.close()
                    self._spawner = None
                await self._reconcile()   # kills whatever the destroys did not, removes everything
        errors = [str(r) for r in results if isinstance(r, Exception) and not isinstance(r, SandboxGone)]
        if errors:
            raise BackendError(f"stop: {'; '.join(errors)}")

    def sandboxes(self) -> list[str]:
        """Ids of the running sandboxes."""
        return [i for i, sb in self._sandboxes.items() if sb.dying is None]

    @property
    def launcher_pid(self) -> int | None:
        """Pid of the zygote (for tests and diagnostics)."""
        return self._launcher.proc.pid if self._launcher.proc else None

    def residue(self, sandbox_id: str) -> list[str]:
        """What still exists of a sandbox (cgroups, processes, writable layer, untracked layer mounts)."""
        out: list[str] = []
        key = self._key(sandbox_id)
        for path in self._cgroups.sandbox(key).values():
            if path.exists():
                out.append(f"cgroup {path}")
                out.extend(f"process {pid} in {path}" for pid in cgroups.procs_under(path))
        if (self._uppers.root / key).exists():
            out.append(f"writable layer {self._uppers.root / key}")
        used = {str(p) for p in [*self._layers.in_use(), *self._layers.idle()]}
        out.extend(f"untracked layer mount {p}" for p in mount_points()
                   if Path(p).parent == self._layers.root and p not in used)
        return out

    def leftovers(self) -> list[str]:
        """Everything this node's backend left on the host (see leftovers())."""
        return leftovers(self.state_dir, self.node_id)

    def busy(self) -> bool:
        return bool(self._sandboxes or self._starting)

    def leaks(self) -> list[str]:
        out = [f"layer reference {k}" for k in self._layers.in_use()]
        idle = {str(p) for p in self._layers.idle()}
        out += [f"untracked layer mount {p}" for p in mount_points()
                if p.startswith(f"{self._layers.root}/") and p not in idle]
        if len(idle) > IDLE_KEEP:
            out.append(f"{len(idle)} idle layer mounts kept (at most {IDLE_KEEP})")
        uppers = self._uppers.root
        out += [f"writable layer {p}" for p in (sorted(uppers.iterdir()) if uppers.is_dir() else [])]
        return out + watcher.leaks()


def leftovers(state_dir: Path, node_id: str) -> list[str]:
    """Everything a node left behind: mounts under state_dir, dsec-<node> cgroups and their processes,
    loop devices on its pool image, its zygote."""
    state_dir = Path(state_dir).resolve()
    out = [f"mount {p}" for p in mount_points() if p == str(state_dir) or p.startswith(f"{state_dir}/")]
    out.extend(NodeCgroups(node_id).describe())
    out.extend(f"loop device {d}" for d in loop_devices(state_dir / "uppers.btrfs"))
    out.extend(f"uid range lease {i} ({key})" for i, key in idmap.Allocator(node_id).held().items()
               if key != idmap.DRAINING)
    out.extend(f"lxcfs process {pid}" for pid in procviews.leftover_daemons(str(state_dir / "lxcfs")))
    label = f"{state_dir}:{node_id}".encode()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if b"edge.backends.zygote" in cmdline and label in cmdline.split(b"\0"):
            out.append(f"zygote process {proc.name}")
    return out
