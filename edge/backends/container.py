"""Container sandboxes: pid/mnt/net/uts/ipc namespaces, cgroup v1 limits, overlayfs over EROFS layers.

Lifecycle: start() reconciles what a crashed run of this node left (processes, cgroups, mounts,
writable layers, uid leases), then formats the writable-layer pool and starts the zygote (see
zygote.py), which forks every sandbox init (catatonit -P); commands are started by dsec-enter (see
enter.py). Each sandbox's root is a host uid range of its own (idmap.py). Work: create/exec/files/
destroy. A sandbox costs the host its catatonit (~50 KiB), its namespaces and mounts; no Python process.
"""
from __future__ import annotations

import asyncio
import collections
import errno
import itertools
import logging
import os
import re
import shutil
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from edge.backends import cgroups, enter, execio, idmap, kernel, native, packing, procviews, rootfiles, zygote
from edge.backends.base import (Backend, BackendError, CapacityExhausted, ExecControl, ExecResult, LayerUnusable,
                                OutputSink, SandboxGone, SandboxSpec, SnapshotTooLarge)
from edge.backends.cgroups import CgroupError, NodeCgroups
from edge.backends.layermounts import LayerError, LayerMounts
from edge.backends.uppers import UpperError, UpperPool, loop_devices, mount_points, mounted_at
from edge.backends.launcher import Launcher
from edge.backends.zygote import Launch, LauncherError, Refresh

__all__ = ["ContainerBackend", "ExecFailed", "leftovers"]

log = logging.getLogger(__name__)

ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
DEFAULT_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root"}
LAUNCH_TIMEOUT = 30.0
REAP_TIMEOUT = 10.0
RELEASE_RETRIES = (0.001, 0.004, 0.02, 0.1, 0.5)   # seconds between looks at a draining range
KEYS_KEPT = 4096            # claimed warm sandboxes whose cgroup/layer names residue() can still tell


class ExecFailed(BackendError):
    """The command never started (not found, bad cwd...); .result carries exit_code -1."""

    def __init__(self, message: str, result: ExecResult) -> None:
        super().__init__(message)
        self.result = result


@dataclass
class _Sandbox:
    """What the backend keeps about one running sandbox."""

    spec: SandboxSpec
    init_pid: int
    init_exit: asyncio.Future
    layers: list[Path]
    ids: idmap.IdRange
    pidfd: int = -1             # pins the init: /proc/<pid> opens are checked against it (pid reuse)
    execs: itertools.count = field(default_factory=lambda: itertools.count(1))
    events: Counter = field(default_factory=Counter)    # limit events of removed exec groups
    dying: asyncio.Future | None = None
    frozen_since: float | None = None   # monotonic time of the freeze (suspended), else None
    frozen_total: float = 0.0           # seconds spent frozen before that
    key: str = ""                       # names its cgroups and writable layer: its first id (a warm
                                        # sandbox keeps its pool name when a create claims it)

    def __post_init__(self) -> None:
        self.key = self.key or self.spec.id

    def frozen_for(self) -> float:
        """Seconds this sandbox has spent frozen so far (exec timeouts do not count them)."""
        return self.frozen_total + (time.monotonic() - self.frozen_since if self.frozen_since is not None else 0.0)


class ContainerBackend(Backend):
    """Sandboxes made directly of namespaces, cgroups and mounts (crun refuses hybrid cgroups here)."""

    def __init__(self, state_dir: Path, node_id: str, *, upper_pool_size: int = 64 << 30,
                 init_binary: str = "/usr/bin/catatonit") -> None:
        if not ID_RE.match(node_id):
            raise BackendError(f"invalid node id: {node_id!r}")
        self.state_dir = Path(state_dir).resolve()
        if any(c in str(self.state_dir) for c in ",:= "):
            raise BackendError(f"state dir must not contain , : = or space (overlay options): {self.state_dir}")
        self.node_id = node_id
        self._cgroups = NodeCgroups(node_id)
        self._uppers = UpperPool(self.state_dir, upper_pool_size)
        self._layers = LayerMounts(self.state_dir / "layers")
        self._empty = self.state_dir / "empty"     # the lowerdir of a sandbox without layers
        self._trusted = self.state_dir / "trusted"  # the trusted shell, bind-mounted at /.dsec in every sandbox
        self._launcher = Launcher(init_binary, label=f"{self.state_dir}:{node_id}")
        self._sandboxes: dict[str, _Sandbox] = {}
        self._keys: collections.OrderedDict[str, str] = collections.OrderedDict()   # claimed id -> key
        self._starting: set[str] = set()
        self._spawner: enter.Spawner | None = None   # exec spawns (dsec-enter, built at start)
        self._ids = idmap.Allocator(node_id)
        self._views = procviews.ProcViews(self.state_dir, self._refresh_views, serving=lambda: self._launcher.alive)
        self._io_device = ""                          # the pool's loop device: sandboxes' I/O is throttled on it
        self._drains: set[asyncio.Task] = set()       # ranges looked at again while their keys are collected

    # ------------------------------------------------------------ lifecycle

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
            self._layers.root.mkdir(exist_ok=True)
            self._empty.mkdir(exist_ok=True)
            await self._launcher.start()
            await self._views.start()
        except (OSError, UpperError, LauncherError) as exc:
            await self._reconcile()
            raise BackendError(f"container backend failed to start: {exc}") from exc

    async def _refresh_views(self) -> None:
        """lxcfs was started again: fresh /proc views into every running sandbox (through the zygote)."""
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
        """state_dir/trusted/sh: a root-owned, read-only copy of the host's static busybox, on a small
        tmpfs of its own (bind-mounted into sandboxes, whose mountinfo then shows "/", not a host path)."""
        from edge.erofs import LayerBuildError, find_busybox
        try:
            src = find_busybox()
        except LayerBuildError as exc:   # only a dynamic busybox (or none): no trusted shell
            raise OSError(f"no trusted shell: {exc}") from exc
        self._trusted.mkdir(mode=0o755, exist_ok=True)
        if not mounted_at(self._trusted):
            kernel.mount("tmpfs", self._trusted, "tmpfs", kernel.MS_NOSUID | kernel.MS_NODEV, "size=8m,mode=755")
        sh = self._trusted / "sh"
        tmp = self._trusted / "sh.tmp"
        shutil.copyfile(src, tmp)
        os.chmod(tmp, 0o555)
        os.replace(tmp, sh)

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

    # ------------------------------------------------------------ create / destroy

    async def create(self, spec: SandboxSpec) -> None:
        """Start a sandbox; returns once its init runs. Nothing is left behind on failure."""
        if not self._launcher.alive:
            raise BackendError(f"container backend unavailable: {self._launcher.death}")
        if not ID_RE.match(spec.id):
            raise BackendError(f"invalid sandbox id: {spec.id!r}")
        if spec.id in self._sandboxes or spec.id in self._starting:
            raise BackendError(f"sandbox already exists: {spec.id}")
        self._starting.add(spec.id)
        self._keys.pop(spec.id, None)   # started again under its own name (a rollback of a claimed one)
        try:
            self._sandboxes[spec.id] = await self._launch(spec)
        finally:
            self._starting.discard(spec.id)

    async def _launch(self, spec: SandboxSpec) -> _Sandbox:
        layers: list[Path] = []
        groups: dict[str, Path] | None = None
        sub: Path | None = None
        init: tuple[int, asyncio.Future] | None = None
        ids: idmap.IdRange | None = None
        try:
            ids = self._ids.lease(spec.id)
            layers = self._layers.acquire(spec.layers)
            sub = self._uppers.create(spec.id, spec.limits.disk)
            groups = self._cgroups.create_sandbox(spec.id, spec.limits, self._io_device)
            lowers = [str(p) for p in reversed(layers)] or [str(self._empty)]
            ready_r, ready_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
            try:
                msg = Launch(hostname=spec.id, cgroups=[str(p) for p in groups.values()], lowers=lowers,
                             upper=str(sub / "upper"), work=str(sub / "work"), merged=str(sub / "merged"),
                             trusted=str(self._trusted), uid_base=ids.base, empty=str(self._empty),
                             base=str(self.state_dir), views=self._views.proc_dir)
                try:
                    init = await self._launcher.request(msg, [ready_w])
                finally:
                    os.close(ready_w)
                error = await asyncio.wait_for(execio.read_to_eof(ready_r), LAUNCH_TIMEOUT)
            finally:
                os.close(ready_r)
            if error:
                raise BackendError(f"sandbox {spec.id} failed to start: {error.decode(errors='replace')}")
            return _Sandbox(spec, init[0], init[1], layers, ids, pidfd=os.pidfd_open(init[0]))
        except BaseException as exc:
            await self._teardown(spec.id, init, groups, sub is not None, layers, ids)
            if isinstance(exc, LayerError):
                raise LayerUnusable(f"sandbox {spec.id}: {exc}") from exc
            if isinstance(exc, LauncherError) and zygote.USERNS_EXHAUSTED in str(exc):
                raise CapacityExhausted(f"sandbox {spec.id}: {exc}") from exc
            if isinstance(exc, (UpperError, CgroupError, LauncherError, OSError)):
                raise BackendError(f"sandbox {spec.id}: {exc}") from exc
            if isinstance(exc, asyncio.TimeoutError):
                raise BackendError(f"sandbox {spec.id} did not start within {LAUNCH_TIMEOUT:.0f}s") from exc
            raise

    async def claim(self, warm_id: str, spec: SandboxSpec) -> None:
        """Give a running, never used sandbox (a warm one) the identity of spec: its id, hostname and
        default env. Its layers and limits must be spec's (the caller matched them). On failure it is
        left as it was (the caller destroys it)."""
        sb = self._live(warm_id)
        if not ID_RE.match(spec.id):
            raise BackendError(f"invalid sandbox id: {spec.id!r}")
        if spec.id in self._sandboxes or spec.id in self._starting:
            raise BackendError(f"sandbox already exists: {spec.id}")
        if sb.frozen_since is not None or next(sb.execs) != 1:
            raise BackendError(f"sandbox {warm_id} is not a fresh one")
        sb.execs = itertools.count(1)
        self._set_hostname(sb, spec.id)
        self._sandboxes[spec.id] = self._sandboxes.pop(warm_id)
        sb.spec = spec
        self._keys[spec.id] = sb.key
        while len(self._keys) > KEYS_KEPT:
            self._keys.popitem(last=False)

    def _set_hostname(self, sb: _Sandbox, name: str) -> None:
        """sethostname in the sandbox's UTS namespace: this thread goes in and straight back (setns moves
        only the calling thread; two syscalls, no thread hand-off on the claim path)."""
        try:
            own = os.open("/proc/thread-self/ns/uts", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise BackendError(f"cannot open this thread's UTS namespace: {exc}") from exc
        try:
            try:
                kernel.setns(sb.pidfd, kernel.CLONE_NEWUTS)
            except OSError as exc:
                raise BackendError(f"cannot enter the UTS namespace of {sb.spec.id}: {exc}") from exc
            try:
                kernel.sethostname(name)
            except OSError as exc:
                raise BackendError(f"cannot set the hostname of {sb.spec.id}: {exc}") from exc
            finally:
                try:
                    kernel.setns(own, kernel.CLONE_NEWUTS)   # back home (we hold its fd: it cannot fail)
                except OSError:   # if it ever did, every process forked later would be in a sandbox's
                    log.critical("edge thread stuck in the UTS namespace of %s: aborting", sb.spec.id)
                    os.abort()    # namespace: die; the restart reconciles everything
        finally:
            os.close(own)

    def _key(self, sandbox_id: str) -> str:
        """What names a sandbox's cgroups and writable layer (its id, unless it was a warm one)."""
        sb = self._sandboxes.get(sandbox_id)
        return sb.key if sb is not None else self._keys.get(sandbox_id, sandbox_id)

    async def destroy(self, sandbox_id: str) -> None:
        """Kill every process, remove cgroups and the writable layer, release layers. Idempotent."""
        sb = self._sandboxes.get(sandbox_id)
        if sb is None:
            raise SandboxGone(f"no such sandbox: {sandbox_id}")
        if sb.dying is None:
            sb.dying = asyncio.ensure_future(self._destroy(sb))
        await asyncio.shield(sb.dying)

    async def _destroy(self, sb: _Sandbox) -> None:
        try:
            groups = self._cgroups.sandbox(sb.key)
            residue = await self._teardown(sb.key, (sb.init_pid, sb.init_exit), groups, True, sb.layers, sb.ids)
        finally:
            self._sandboxes.pop(sb.spec.id, None)
            if sb.pidfd >= 0:
                os.close(sb.pidfd)
                sb.pidfd = -1
        if residue:
            raise BackendError(f"destroy {sb.spec.id} left: {'; '.join(residue)}")

    async def _teardown(self, key: str, init: tuple[int, asyncio.Future] | None,
                        groups: dict[str, Path] | None,
                        upper: bool, layers: list[Path], ids: idmap.IdRange | None = None) -> list[str]:
        """Undo a (partial) launch in reverse order; return what could not be removed. The uid range goes
        back only when every process is gone (else it stays leased: a leftover keeps its identity)."""
        residue: list[str] = []
        gone = False
        try:
            # Kill init by pid only while it is unreaped: after that its pid may belong to anyone.
            live_init = init[0] if init and not init[1].done() else None
            if groups and not await cgroups.kill_tree(groups["freezer"], init=live_init):
                residue.append(f"processes survive in {groups['freezer']}")
            if init is not None:
                await self._reap(*init)
            if groups:
                busy = await self._remove_groups(groups)
                residue.extend(busy)
                gone = not busy
            if upper:
                try:
                    await asyncio.to_thread(self._uppers.remove, key)
                except UpperError as exc:
                    residue.append(str(exc))
        finally:
            self._layers.release(layers)   # whatever failed above, the layer references go
            if ids is not None and (gone or not groups) and not self._ids.release(ids):
                self._drains.add(asyncio.ensure_future(self._release_later(ids)))
        return residue

    async def _release_later(self, ids: idmap.IdRange) -> None:
        """Look again at a range left draining: the kernel collects the session keyrings of its last
        commands just after they end, so it is usually free within milliseconds (and then the next
        sandbox reuses it and its user namespace, instead of making new ones)."""
        try:
            for delay in RELEASE_RETRIES:
                await asyncio.sleep(delay)
                if self._ids.release_drained(ids) or not self._ids.draining_ours(ids):
                    return   # given back, or (its keys gone) another edge took it meanwhile
        finally:
            self._drains.discard(asyncio.current_task())

    @staticmethod
    async def _reap(pid: int, exited: asyncio.Future) -> None:
        """Wait until the zygote reaped pid (or, with the zygote gone, until pid vanished)."""
        try:
            await asyncio.wait_for(asyncio.shield(exited), REAP_TIMEOUT)
        except (LauncherError, asyncio.TimeoutError):
            deadline = time.monotonic() + REAP_TIMEOUT
            while not execio.pid_gone(pid) and time.monotonic() < deadline:
                await asyncio.sleep(0.005)

    @staticmethod
    async def _remove_groups(groups: dict[str, Path], timeout: float = 5.0) -> list[str]:
        """rmdir groups, retrying while killed tasks are still being released."""
        deadline = time.monotonic() + timeout
        while True:
            busy = NodeCgroups.remove(groups)
            if not busy or time.monotonic() > deadline:
                return busy
            await asyncio.sleep(0.002)

    async def freeze(self, sandbox_id: str) -> None:
        """Freeze the sandbox's freezer group: its init, its execs, everything they started."""
        sb = self._live(sandbox_id)
        if sb.frozen_since is not None:
            return
        group = self._cgroups.sandbox(sb.key)["freezer"]
        sb.frozen_since = time.monotonic()
        try:
            if not await cgroups.freeze(group):
                cgroups.thaw(group)
                raise BackendError(f"sandbox {sandbox_id} did not freeze within 5 s (a task in uninterruptible sleep)")
        except OSError as exc:
            raise BackendError(f"cannot freeze {sandbox_id}: {exc}") from exc
        except BaseException:
            sb.frozen_since = None
            raise

    async def pack_upper(self, sandbox_id: str, dst: str) -> str:
        """Freeze (unless suspended already), pack upper/ with mkfs.erofs, thaw: the freeze lasts the pack.
        The layer is read through an idmapped view, so its files are owned relative to the sandbox. A
        layer whose files add up (at their apparent size: sparse files and reflinks count in full, as
        mkfs.erofs stores them) to more than the sandbox's disk limit is refused (SnapshotTooLarge)."""
        from edge.erofs import LayerBuildError
        sb = self._live(sandbox_id)
        was_frozen = sb.frozen_since is not None
        if not was_frozen:
            await self.freeze(sandbox_id)
        try:
            upper = self._uppers.root / sb.key / "upper"
            size = await asyncio.to_thread(packing.apparent_size, upper)
            if size > sb.spec.limits.disk:
                raise SnapshotTooLarge(f"snapshot of {sandbox_id} refused: its files add up to {size} bytes "
                                       f"(sparse and reflinked files counted at their apparent size), above "
                                       f"its disk limit of {sb.spec.limits.disk} bytes")
            return await asyncio.to_thread(packing.pack_relative, upper, Path(dst), sb.ids)
        except (LayerBuildError, OSError) as exc:
            raise BackendError(f"snapshot of {sandbox_id} failed: {exc}") from exc
        finally:
            if not was_frozen:
                await self.thaw(sandbox_id)

    async def thaw(self, sandbox_id: str) -> None:
        """Thaw it: every process runs on from where it stopped."""
        sb = self._live(sandbox_id)
        if sb.frozen_since is None:
            return
        try:
            cgroups.thaw(self._cgroups.sandbox(sb.key)["freezer"])
        except OSError as exc:
            raise BackendError(f"cannot thaw {sandbox_id}: {exc}") from exc
        sb.frozen_total += time.monotonic() - sb.frozen_since
        sb.frozen_since = None

    def _live(self, sandbox_id: str) -> _Sandbox:
        sb = self._sandboxes.get(sandbox_id)
        if sb is None or sb.dying is not None:
            raise SandboxGone(f"no such sandbox: {sandbox_id}")
        if not self._launcher.alive:
            raise BackendError(f"container backend unavailable: {self._launcher.death}")
        if sb.init_exit.done():
            raise BackendError(f"sandbox {sandbox_id} is not running (its init exited); destroy it")
        return sb

    # ------------------------------------------------------------ exec

    async def exec(self, sandbox_id: str, argv: list[str], *, env: dict[str, str], cwd: str,
                   stdin: bytes | None, timeout: float, sink: OutputSink,
                   control: ExecControl | None = None) -> ExecResult:
        """Run argv inside the sandbox (timeout <= 0: none); see ExecFailed for commands that never start."""
        sb = self._live(sandbox_id)
        if not argv:
            raise BackendError("empty command")
        n = next(sb.execs)
        try:
            groups = self._cgroups.create_exec(sb.key, n)
        except CgroupError as exc:
            raise BackendError(str(exc)) from exc
        pipes = execio.Pipes()
        started = time.monotonic()
        try:
            try:
                exited = self._start_exec(sb, n, list(argv), {**DEFAULT_ENV, **sb.spec.env, **env}, cwd or "/",
                                          pipes)
            finally:
                pipes.close_child_ends()    # else our copies of the write ends would hide EOF
            if control is not None:
                control.on_signal(lambda sig: execio.signal_exec(groups, sig))
            status, timed_out = await execio.supervise(exited, groups, pipes, stdin, timeout, sink, control,
                                                     sb.frozen_for)
            failure = execio.exec_failure(pipes.read_error(), argv, cwd)
        finally:
            pipes.close()
            cpu, peak = NodeCgroups.exec_stats(groups)
            events = NodeCgroups.limit_events(groups)
            if not NodeCgroups.remove(groups):  # stays if background processes remain; destroy removes it
                sb.events.update(events)
        result = ExecResult(exit_code=execio.exit_code(status), duration=time.monotonic() - started,
                            cpu_time=cpu, peak_memory=peak, timed_out=timed_out)
        if failure and not timed_out:
            raise ExecFailed(failure, ExecResult(-1, result.duration, cpu, peak))
        return result

    def _start_exec(self, sb: _Sandbox, n: int, argv: list[str], env: dict[str, str], cwd: str,
                    pipes: "execio.Pipes") -> asyncio.Future:
        """Spawn dsec-enter for the command; a future of the command's wait status (see enter.py)."""
        if self._spawner is None:
            raise BackendError("container backend is not started")
        ends = pipes.child_ends()
        tasks = [f"{g}/tasks" for g in self._cgroups.exec_join(sb.key, n)]
        try:
            pid = self._spawner.spawn(sb.init_pid, sb.pidfd, tasks, argv, env, cwd, ends[:3], ends[3])
        except (ProcessLookupError, FileNotFoundError) as exc:   # the init is gone (or a zombie)
            raise SandboxGone(f"sandbox {sb.spec.id} is not running") from exc
        except OSError as exc:
            raise BackendError(f"cannot start {argv[0]}: {exc.strerror}") from exc
        try:
            return enter.watch_exit(pid)
        except OSError as exc:   # cannot watch it (out of fds): do not leave it running unwatched
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise BackendError(f"cannot watch {argv[0]}: {exc.strerror}") from exc

    # ------------------------------------------------------------ files

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None:
        """Create or truncate a file in the sandbox root filesystem (symlinks resolved inside it)."""
        sb = self._live(sandbox_id)
        pidfd = os.dup(sb.pidfd)   # our own copy: destroy may close the sandbox's while the thread runs
        await asyncio.to_thread(rootfiles.write, sandbox_id, sb.init_pid, pidfd, path, data, mode, sb.ids.base)

    async def read_file(self, sandbox_id: str, path: str, limit: int) -> bytes:
        """Read a file of the sandbox root filesystem, at most limit bytes (else BackendError)."""
        sb = self._live(sandbox_id)
        pidfd = os.dup(sb.pidfd)   # our own copy: destroy may close the sandbox's while the thread runs
        return await asyncio.to_thread(rootfiles.read, sandbox_id, sb.init_pid, pidfd, path, limit)

    # ------------------------------------------------------------ checks

    def cgroup_dir(self, sandbox_id: str, controller: str) -> Path:
        """The sandbox's group directory in one controller (tests read limit events there)."""
        return self._cgroups.sandbox(self._key(sandbox_id))[controller]

    def limit_events(self, sandbox_id: str) -> dict[str, int]:
        """How often each limit fired in a sandbox so far: pids_max, oom_kill, memory/memsw failcnt."""
        sb = self._live(sandbox_id)
        total = Counter(sb.events)
        top = self._cgroups.sandbox(sb.key)
        total.update(NodeCgroups.limit_events(top))
        for child in top["pids"].glob("x*"):
            total.update(NodeCgroups.limit_events({c: p / child.name for c, p in top.items()
                                                   if c in cgroups.EXEC_CONTROLLERS}))
        return dict(total)

    def init_pid(self, sandbox_id: str) -> int:
        """Host pid of the sandbox's init."""
        return self._live(sandbox_id).init_pid

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
