"""gVisor sandboxes: the container backend's layered root (EROFS layers + a capped btrfs upper, overlaid
on the host) run under runsc, whose sentry answers the sandbox's syscalls instead of the host kernel.

Per sandbox: the layers' shared read-only mounts get idmapped views (host root shows as the sandbox's
range base, idmap.py), overlaid with its upper at <run dir>/<key>; runsc's gofer and sentry run in a user
namespace mapping 0..65535 onto that range (the OCI spec's uid/gid mappings), so nothing it writes is
owned by host root. Its pid 1 is dsec-agent (native/dsec-agent.c, bind-mounted read-only at /.dsec
with the trusted shell), which runs every exec; see gvisor/agent.py for the channel. `runsc run
--detach` is started inside the sandbox's host cgroups (--ignore-cgroups: runsc's own v1 setup is not
used), so memory, pids and cpu limits hold for sentry, gofer and the sandbox's processes together, and
destroy kills by freezer group whatever runsc leaves. Files are read, written, listed and watched
host-side in the root (gvisor/files.py); --file-access=shared makes the sentry see those writes at once.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from bus import kinds
from edge.backends import cgroups, idmap, kernel, watcher
from edge.backends.base import (Backend, BackendError, ExecControl, ExecResult, LayerUnusable, OutputSink,
                                SandboxGone, SandboxSpec, TRUSTED_DIR)
from edge.backends.cgroups import CgroupError, NodeCgroups
from edge.backends.gvisor import net
from edge.backends.gvisor.agent import AgentChannel
from edge.backends.gvisor.files import RootFiles, cover_view
from edge.backends.gvisor.host import (_remove_groups, _tail, host_limits,
                                        runsc_processes, valid_id)
from edge.backends.layermounts import LayerError, LayerMounts
from edge.backends.native import AGENT_SOURCE, GUEST_HEADERS
from edge.backends.uppers import UpperError, UpperPool, loop_devices, mount_points

__all__ = ["GvisorBackend", "leftovers"]

DEFAULT_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root"}
READY_TIMEOUT = 30.0
# Capabilities of the agent (Docker's default set, plus CAP_SYS_ADMIN for sethostname); execs drop SYS_ADMIN.
CAPS = ["CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW", "CAP_SETGID",
        "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_KILL",
        "CAP_AUDIT_WRITE", "CAP_SYS_ADMIN"]


@dataclass
class _Sandbox:
    """What the backend keeps about one running sandbox."""

    spec: SandboxSpec
    key: str                    # names its cgroups, upper, bundle and runsc container (its first id)
    ids: idmap.IdRange
    layers: list[Path]
    chan: AgentChannel | None = None
    end: object | None = None   # its network end (aether.links.End), None without a network
    dying: asyncio.Future | None = None
    frozen_since: float | None = None
    frozen_total: float = 0.0

    def frozen_for(self) -> float:
        """Seconds spent frozen so far (exec timeouts do not count them)."""
        return self.frozen_total + (time.monotonic() - self.frozen_since if self.frozen_since is not None else 0.0)


class GvisorBackend(RootFiles, Backend):
    """Sandboxes under runsc (ptrace platform; a network through Aether, net.py), one agent each."""

    kind = kinds.GVISOR

    def __init__(self, state_dir: Path, node_id: str, *, runsc: str = "runsc", platform: str = "ptrace",
                 upper_pool_size: int = 16 << 30) -> None:
        self.state_dir = Path(state_dir).resolve()   # beside the container backend's (registry.kind_dir)
        self.node_id = node_id
        self.label = f"{node_id}.gvisor"         # its cgroups (dsec-<label>) and uid leases
        self.runsc = shutil.which(runsc) or runsc
        self.flags = [f"--root={self.state_dir / 'runsc'}", f"--platform={platform}", "--network=none",
                      "--ignore-cgroups", "--file-access=shared", "--overlay2=none", "--host-uds=none"]
        self._cgroups = NodeCgroups(self.label)
        self._uppers = UpperPool(self.state_dir, upper_pool_size)
        self._layers = LayerMounts(self.state_dir / "layers")
        self._ids = idmap.Allocator(self.label)
        # What the gofer (the range's uid, not root) opens: the roots and the trusted dir, under a run dir
        # traversable by others (0711, nothing listable), so the state dir itself can stay private.
        self._public = Path(os.environ.get("DSEC_RUN_DIR", "/run/dsec")) / "gvisor" / self.label
        self._trusted = self._public / "trusted"
        self._empty = self.state_dir / "empty"
        self._visible_proc = self.state_dir / "proc"   # runsc's whole proc, in its own mount namespace (net.py)
        self._userns: dict[int, int] = {}        # range base -> fd of a user namespace mapping 0.. onto it
        self._sandboxes: dict[str, _Sandbox] = {}
        self._io_device = ""

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Reconcile a crashed run's leftovers, then prepare cgroups, the upper pool, agent and shell."""
        self.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.state_dir, 0o700)
        for d in (self._public.parent, self._public):
            d.mkdir(mode=0o711, parents=True, exist_ok=True)
            os.chmod(d, 0o711)
        blocked = [str(p) for p in self._public.parents if not p.stat().st_mode & 0o001]
        if blocked:
            raise BackendError(f"gvisor run dir {self._public}: {blocked[0]} is not traversable by others "
                               f"(chmod o+x, or set DSEC_RUN_DIR): runsc's gofer runs as the sandbox's uid range")
        await self._reconcile()
        try:
            self._cgroups.setup()   # (lifts the host's tables: its gofer's files too are its memory group's)
            await asyncio.to_thread(self._uppers.setup)
            self._io_device = self._uppers.device()
            await asyncio.to_thread(self._prepare_trusted)
            self._layers.root.mkdir(exist_ok=True)
            self._empty.mkdir(exist_ok=True)
            self._visible_proc.mkdir(exist_ok=True)
            (self.state_dir / "sandboxes").mkdir(exist_ok=True)
        except (OSError, UpperError, CgroupError, subprocess.CalledProcessError) as exc:
            await self._reconcile()
            raise BackendError(f"gvisor backend failed to start: {exc}") from exc

    def _prepare_trusted(self) -> None:
        """trusted/: the static shell and busybox (chronus/shell.py) and the agent, built from source, all
        root-owned 0555."""
        from edge.erofs import find_busybox, find_trusted_shell
        self._trusted.mkdir(mode=0o755, exist_ok=True)
        for name, src in (("sh", find_trusted_shell()), ("busybox", find_busybox())):
            shutil.copyfile(src, self._trusted / f"{name}.tmp")
            os.chmod(self._trusted / f"{name}.tmp", 0o555)
            os.replace(self._trusted / f"{name}.tmp", self._trusted / name)
        agent = self._trusted / "agent"
        newest = max(src.stat().st_mtime for src in (AGENT_SOURCE, *GUEST_HEADERS))
        if not agent.exists() or agent.stat().st_mtime < newest:
            cc = shutil.which("cc") or shutil.which("gcc") or "cc"
            subprocess.run([cc, "-O2", "-static", "-Wall", "-o", f"{agent}.tmp", str(AGENT_SOURCE)],
                           check=True, capture_output=True)
            os.chmod(f"{agent}.tmp", 0o555)
            os.replace(f"{agent}.tmp", agent)

    async def _reconcile(self) -> None:
        """Delete every runsc container of our root, kill and remove our cgroups, unmount everything."""
        root = self.state_dir / "runsc"
        for cid in self._containers():
            await self._runsc("delete", "--force", cid, check=False)
        problems = await self._cgroups.reconcile()
        for point in reversed(mount_points()):
            if (point.startswith(f"{self.state_dir}/") and point != str(self._uppers.root)) \
                    or point.startswith(f"{self._public}/"):
                kernel.umount2(point, kernel.MNT_DETACH)
        self._layers.unmount_all()
        await asyncio.to_thread(self._uppers.teardown)
        shutil.rmtree(self.state_dir / "sandboxes", ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
        for entry in (os.listdir(self._public) if self._public.is_dir() else []):
            if entry != "trusted":
                shutil.rmtree(self._public / entry, ignore_errors=True)
        if not problems:
            self._ids.setup()
            await asyncio.to_thread(self._ids.reclaim)
        for fd in self._userns.values():
            os.close(fd)
        self._userns.clear()
        if problems:
            raise BackendError(f"cannot clean up gvisor node {self.node_id}: {'; '.join(problems)}")

    async def stop(self) -> None:
        """Destroy every sandbox, then remove whatever is left (cgroups, mounts, the pool)."""
        try:
            results = await asyncio.gather(*(self.destroy(i) for i in list(self._sandboxes)),
                                           return_exceptions=True)
        finally:
            await self._reconcile()
            if not any(p.startswith(f"{self._public}/") for p in mount_points()):   # never into a mount
                shutil.rmtree(self._public, ignore_errors=True)   # its run dir goes with the node
        errors = [str(r) for r in results if isinstance(r, Exception) and not isinstance(r, SandboxGone)]
        if errors:
            raise BackendError(f"stop: {'; '.join(errors)}")

    def _containers(self) -> list[str]:
        """Ids of the containers runsc keeps state of in our root (files <sandbox>_sandbox:<id>.state)."""
        root = self.state_dir / "runsc"
        names = os.listdir(root) if root.is_dir() else []
        return [n.rpartition("_sandbox:")[2][:-len(".state")] for n in names if n.endswith(".state")]

    def sandboxes(self) -> list[str]:
        """Ids of the running sandboxes."""
        return [i for i, sb in self._sandboxes.items() if sb.dying is None]

    async def _runsc(self, *args: str, check: bool = True, timeout: float = 30.0) -> str:
        proc = await asyncio.create_subprocess_exec(self.runsc, *self.flags, *args, stdin=subprocess.DEVNULL,
                                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
        if check and proc.returncode != 0:
            raise BackendError(f"runsc {args[0]} failed: {out.decode(errors='replace').strip()[-300:]}")
        return out.decode(errors="replace")

    # ------------------------------------------------------------ create / destroy

    def _dir(self, key: str) -> Path:
        return self.state_dir / "sandboxes" / key

    async def create(self, spec: SandboxSpec) -> None:
        """Start a sandbox; returns once its agent answered. Nothing is left behind on failure."""
        if not valid_id(spec.id):
            raise BackendError(f"invalid sandbox id: {spec.id!r}")
        if spec.id in self._sandboxes:
            raise BackendError(f"sandbox already exists: {spec.id}")
        sb = self._sandboxes[spec.id] = _Sandbox(spec, spec.id, idmap.IdRange(-1), [])
        try:
            sb.end = await self.attach_network(spec)
            if sb.end is not None:     # its commands find the proxy by HTTP(S)_PROXY too
                sb.spec = dataclasses.replace(spec, env={**self.network.sandbox_env(sb.end), **spec.env})
            sb.ids = self._ids.lease(sb.key)
            sb.layers = self._layers.acquire(spec.layers)
            await asyncio.to_thread(self._prepare_root, sb)
            groups = await self._cgroups.create_sandbox_off_loop(sb.key, host_limits(spec.limits), self._io_device)
            sb.chan = await self._boot(sb, groups)
            sb.chan.closed.add_done_callback(lambda _: self._agent_gone(sb))
            if sb.end is not None:     # its policy went to the proxy while it booted
                await self.network_in_force(sb.spec)
        except BaseException as exc:
            sb.dying = asyncio.get_running_loop().create_future()
            try:
                await self._teardown(sb)
            finally:
                self._sandboxes.pop(spec.id, None)
            if isinstance(exc, LayerError):
                raise LayerUnusable(f"sandbox {spec.id}: {exc}") from exc
            if isinstance(exc, asyncio.TimeoutError):   # (an OSError too: first, or its text is '')
                raise BackendError(f"sandbox {spec.id} did not start within {READY_TIMEOUT:.0f}s") from exc
            if isinstance(exc, (UpperError, CgroupError, OSError)):
                raise BackendError(f"sandbox {spec.id}: {exc}") from exc
            raise

    def _agent_gone(self, sb: _Sandbox) -> None:
        """Its agent ended while nobody destroyed it (e.g. a command SIGKILLed it: runsc lets a sandbox's
        pid 1 be killed from inside): told to the edge, which destroys the sandbox as failed."""
        if sb.dying is None and self._sandboxes.get(sb.spec.id) is sb and self.died is not None:
            self.died(sb.spec.id, f"its agent ended ({sb.chan.closed.result()})")

    def _prepare_root(self, sb: _Sandbox) -> None:
        """The upper, idmapped views of the layers, the overlay over them, and the OCI bundle."""
        sub = self._uppers.create(sb.key, sb.spec.limits.disk)
        base = sb.ids.base
        os.chown(sub / "upper", base, base)
        for name in ("proc", "dev", "sys", "tmp", TRUSTED_DIR.lstrip("/")):   # mount points, the sandbox's
            (sub / "upper" / name).mkdir()
            os.chown(sub / "upper" / name, base, base)
            os.chmod(sub / "upper" / name, 0o1777 if name == "tmp" else 0o755)   # (past the umask: /tmp was 1755,
                                                                                  # no user could write it: helper G)
        work = self._dir(sb.key)
        work.mkdir(mode=0o700)
        lowers = []
        for i, layer in enumerate(reversed(sb.layers)):      # top layer first, as overlayfs wants
            view = work / f"l{i}"
            view.mkdir()
            kernel.idmap_over(str(layer), self._userns_fd(base), at=str(view))
            lowers.append(str(view))
        opts = (f"lowerdir={':'.join(lowers) or self._empty},upperdir={sub / 'upper'},"
                f"workdir={sub / 'work'},volatile")
        rootfs = self._rootfs(sb.key)
        rootfs.mkdir(mode=0o711)
        kernel.mount("overlay", rootfs, "overlay", kernel.MS_NODEV | kernel.MS_NOSUID, opts)
        cover_view(rootfs, self._files_root(sb.key), base)
        if sb.end is not None:
            root = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                net.write_etc(root, self.network.sandbox_etc(sb.end), base)
            finally:
                os.close(root)
        (work / "bundle").mkdir()
        with open(work / "bundle" / "config.json", "w") as f:
            json.dump(self._oci_spec(sb, rootfs), f)

    def _rootfs(self, key: str) -> Path:
        """Where a sandbox's root is mounted (the gofer opens it as the sandbox's uid)."""
        return self._public / key

    def _files_root(self, key: str) -> Path:
        """The file operations' view of that root (files.cover_view), under its state dir."""
        return self._dir(key) / "files"

    def _userns_fd(self, base: int) -> int:
        """A user namespace whose maps put 0..65535 onto base.. (kept per range: the views' idmap)."""
        if base not in self._userns:
            self._userns[base] = idmap.forward_userns(base)
        return self._userns[base]

    def _oci_spec(self, sb: _Sandbox, rootfs: Path) -> dict:
        limits = sb.spec.limits
        ids = [{"containerID": 0, "hostID": sb.ids.base, "size": idmap.SIZE}]
        return {
            "ociVersion": "1.0.2",
            "process": {"user": {"uid": 0, "gid": 0}, "args": [f"{TRUSTED_DIR}/agent"], "cwd": "/",
                        "env": [f"PATH={DEFAULT_ENV['PATH']}", f"DSEC_PIDS_MAX={limits.pids}"],
                        "capabilities": {k: CAPS for k in ("bounding", "effective", "permitted")},
                        "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1 << 20, "soft": 1 << 20}]},
            "root": {"path": str(rootfs), "readonly": False},
            "hostname": sb.spec.id,
            "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"},   # the sentry's own
                       {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
                       {"destination": "/dev/pts", "type": "devpts", "source": "devpts"},
                       {"destination": "/dev/shm", "type": "tmpfs", "source": "shm"},
                       {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["ro"]},
                       {"destination": TRUSTED_DIR, "type": "bind", "source": str(self._trusted),
                        "options": ["rbind", "ro"]},
                       # else runsc puts a tmpfs (sentry memory) there, which write_file would not reach
                       {"destination": "/tmp", "type": "bind", "source": f"{rootfs}/tmp", "options": ["rbind"]}],
            "linux": {"uidMappings": ids, "gidMappings": ids,
                      "namespaces": [{"type": t} for t in ("pid", "mount", "ipc", "uts", "user")] + [
                          {"type": "network", **({"path": net.netns_path(sb.end.netns)} if sb.end else {})}],
                      "resources": {"memory": {"limit": limits.memory}, "pids": {"limit": limits.pids},
                                    "cpu": {"quota": max(1000, int(limits.cpu * 100000)), "period": 100000}}},
        }

    async def _boot(self, sb: _Sandbox, groups: dict[str, Path]) -> AgentChannel:
        """`runsc run --detach` inside the sandbox's cgroups, the agent's stdio on two pipes; wait for 'R'."""
        work = self._dir(sb.key)
        to_r, to_w = os.pipe2(os.O_CLOEXEC)
        from_r, from_w = os.pipe2(os.O_CLOEXEC)
        log = os.open(work / "agent.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        tasks = [str(g / "tasks") for g in groups.values()]
        netns = sb.end.netns if sb.end is not None else -1
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        flags = [f for f in self.flags if f != "--network=none"] + [
            "--network=sandbox" if sb.end is not None else "--network=none"]
        try:
            proc = await asyncio.create_subprocess_exec(
                self.runsc, *flags, "run", "--detach", "--bundle", str(work / "bundle"), sb.key,
                stdin=to_r, stdout=from_w, stderr=log,
                preexec_fn=lambda: net.launch_prep(tasks, netns, home, str(self._visible_proc), sb.spec.limits.cpu_class))
            rc = await asyncio.wait_for(proc.wait(), READY_TIMEOUT)
        finally:
            for fd in (to_r, from_w, log, home):
                os.close(fd)
        chan = AgentChannel(sb.spec.id, to_w, from_r)
        if rc != 0:
            chan.close()
            raise BackendError(f"sandbox {sb.spec.id}: runsc run failed: {_tail(work / 'agent.log')}")
        try:
            await asyncio.wait_for(asyncio.shield(chan.ready), READY_TIMEOUT)
        except BaseException:
            chan.close()
            raise
        return chan

    async def destroy(self, sandbox_id: str) -> None:
        """Stop the agent, delete the runsc container, kill what is left, unmount, remove. Idempotent."""
        sb = self._sandboxes.get(sandbox_id)
        if sb is None:
            raise SandboxGone(f"no such sandbox: {sandbox_id}")
        if sb.dying is None:
            sb.dying = asyncio.ensure_future(self._destroy(sb))
        await asyncio.shield(sb.dying)

    async def _destroy(self, sb: _Sandbox) -> None:
        try:
            residue = await self._teardown(sb)
        finally:
            self._sandboxes.pop(sb.spec.id, None)
        if residue:
            raise BackendError(f"destroy {sb.spec.id} left: {'; '.join(residue)}")

    async def _teardown(self, sb: _Sandbox) -> list[str]:
        """Undo a (partial) create in reverse order; return what could not be removed."""
        residue: list[str] = []
        groups = self._cgroups.sandbox(sb.key)
        try:
            if sb.chan is not None:
                sb.chan.close()
            if sb.key in self._containers():
                await self._runsc("delete", "--force", sb.key, check=False)
            if groups["freezer"].exists() and not await cgroups.kill_tree(groups["freezer"]):
                residue.append(f"processes survive in {groups['freezer']}")
            residue.extend(await _remove_groups(groups))
            residue.extend(await asyncio.to_thread(self._unmount, sb.key))
            if sb.end is not None:     # its namespace goes once runsc's processes are gone
                await self.network.detach(sb.spec.id)
                sb.end = None
        finally:
            self._layers.release(sb.layers)
            sb.layers = []
            if sb.ids.index >= 0 and not residue:
                self._ids.release(sb.ids)
                fd = self._userns.pop(sb.ids.base, None)
                if fd is not None:
                    os.close(fd)
        return residue

    def _unmount(self, key: str) -> list[str]:
        """Unmount the overlay and the layer views, remove the bundle and the upper."""
        merged = self._rootfs(key)
        work = self._dir(key)
        for point in reversed(mount_points()):
            if point == str(merged) or point.startswith(f"{work}/"):
                try:
                    kernel.umount2(point)
                except kernel.KernelError:
                    kernel.umount2(point, kernel.MNT_DETACH)
        shutil.rmtree(work, ignore_errors=True)
        with contextlib.suppress(OSError):
            merged.rmdir()
        try:
            if (self._uppers.root / key).exists():
                self._uppers.remove(key)
        except UpperError as exc:
            return [str(exc)]
        return []

    async def claim(self, warm_id: str, spec: SandboxSpec) -> None:
        """Give a fresh running sandbox spec's id, hostname and env (its layers and limits are spec's)."""
        sb = self._live(warm_id)
        if spec.id in self._sandboxes or not valid_id(spec.id):
            raise BackendError(f"sandbox already exists or invalid id: {spec.id!r}")
        await sb.chan.set_hostname(spec.id)
        self._sandboxes[spec.id] = self._sandboxes.pop(warm_id)
        sb.spec = spec

    # ------------------------------------------------------------ freeze

    async def freeze(self, sandbox_id: str) -> None:
        """runsc pause: every task of the sandbox stops where it is (the sentry keeps its memory)."""
        sb = self._live(sandbox_id)
        if sb.frozen_since is None:
            await self._runsc("pause", sb.key)
            sb.frozen_since = time.monotonic()

    async def thaw(self, sandbox_id: str) -> None:
        """runsc resume: the sandbox's tasks run on."""
        sb = self._live(sandbox_id)
        if sb.frozen_since is not None:
            await self._runsc("resume", sb.key)
            sb.frozen_total += time.monotonic() - sb.frozen_since
            sb.frozen_since = None

    def _live(self, sandbox_id: str) -> _Sandbox:
        sb = self._sandboxes.get(sandbox_id)
        if sb is None or sb.dying is not None or sb.chan is None:
            raise SandboxGone(f"no such sandbox: {sandbox_id}")
        if sb.chan.closed.done():
            raise BackendError(f"sandbox {sandbox_id} is not running ({sb.chan.closed.result()}); destroy it")
        return sb

    # ------------------------------------------------------------ work

    async def exec(self, sandbox_id: str, argv: list[str], *, env: dict[str, str], cwd: str,
                   stdin: bytes | None, timeout: float, sink: OutputSink,
                   control: ExecControl | None = None, user=None, pty: tuple[int, int] | None = None) -> ExecResult:
        """Run argv through the sandbox's agent (timeout <= 0: none), as user (users.ExecUser; None: root), on
        a terminal of pty's (rows, cols) if given."""
        sb = self._live(sandbox_id)
        if not argv:
            raise BackendError("empty command")
        return await sb.chan.exec(list(argv), {**DEFAULT_ENV, **sb.spec.env, **env}, cwd or "/", stdin,
                                  timeout, sink, control, sb.frozen_for, user=user, pty=pty)

    # ------------------------------------------------------------ checks

    def residue(self, sandbox_id: str) -> list[str]:
        """What still exists of a sandbox: cgroups and their processes, mounts, upper, runsc state."""
        sb = self._sandboxes.get(sandbox_id)
        key = sb.key if sb is not None else sandbox_id
        out: list[str] = []
        for path in self._cgroups.sandbox(key).values():
            if path.exists():
                out.append(f"cgroup {path}")
                out.extend(f"process {pid} in {path}" for pid in cgroups.procs_under(path))
        merged, work = str(self._rootfs(key)), str(self._dir(key))
        out.extend(f"mount {p}" for p in mount_points() if p == merged or p.startswith(f"{work}/"))
        if (self._uppers.root / key).exists():
            out.append(f"writable layer {self._uppers.root / key}")
        if key in self._containers():
            out.append(f"runsc container {key}")
        if self._dir(key).exists():
            out.append(f"bundle {self._dir(key)}")
        out.extend(f"runsc process {pid}" for pid in runsc_processes(self.state_dir, key))
        return out

    def leaks(self) -> list[str]:
        return watcher.leaks()

    def leftovers(self) -> list[str]:
        """Everything of this backend on the host: mounts, cgroups, loop devices, leases, runsc processes."""
        out = [f"mount {p}" for p in mount_points() if p.startswith((f"{self.state_dir}/", f"{self._public}/"))]
        out.extend(NodeCgroups(self.label).describe())
        out.extend(f"loop device {d}" for d in loop_devices(self._uppers.image))
        out.extend(f"uid range lease {i} ({key})" for i, key in self._ids.held().items() if key != idmap.DRAINING)
        out.extend(f"runsc process {pid}" for pid in runsc_processes(self.state_dir))
        return out


def leftovers(state_dir: Path, node_id: str) -> list[str]:
    """Everything a gVisor node (its state in state_dir) left on the host, without starting one."""
    return GvisorBackend(state_dir, node_id).leftovers()
