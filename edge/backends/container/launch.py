"""Starting, claiming and destroying container sandboxes (the zygote forks each init)."""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import signal
import time
from pathlib import Path

from edge.backends import cgroups, execio, hostsfile, idmap, kernel, nskeeper
from edge.backends.base import BackendError, CapacityExhausted, LayerUnusable, SandboxGone, SandboxSpec
from edge.backends.cgroups import CgroupError, NodeCgroups
from edge.backends.container.state import (ID_RE, KEYS_KEPT, LAUNCH_TIMEOUT, REAP_TIMEOUT, RELEASE_RETRIES, Core,
                                           Running)
from edge.backends.layermounts import LayerError
from edge.backends.uppers import UpperError
from edge.backends.zygote import Launch, LauncherError

log = logging.getLogger(__name__)

FINISH_RETRIES = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0)   # s between a destroy's teardowns


class Launching(Core):
    """create / claim / destroy."""

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
            sb = self._sandboxes[spec.id] = await self._launch(spec)
        finally:
            self._starting.discard(spec.id)
        sb.init_exit.add_done_callback(lambda exit_: self._init_ended(sb, exit_))

    def _oom_kills(self, sb: Running) -> int:
        try:
            return self._limit_events(sb).get("oom_kill", 0)   # its exec groups' too: each has the limit
        except (OSError, ValueError):
            return 0

    def _init_ended(self, sb: Running, exit_: asyncio.Future) -> None:
        """Its init ended while nobody destroyed it (the OOM killer chose it, or host root killed it): told to
        the edge, which destroys the sandbox as failed, saying why, instead of listing it as ready until its
        TTL. (A zygote that died fails the future instead: the whole backend is unavailable then.)"""
        if exit_.cancelled() or exit_.exception() is not None or self.died is None:
            return
        if sb.dying is not None or self._sandboxes.get(sb.spec.id) is not sb:
            return
        status = exit_.result()
        if not os.WIFSIGNALED(status):
            how = f"exit status {os.WEXITSTATUS(status)}"
        elif os.WTERMSIG(status) == signal.SIGKILL and (ooms := self._oom_kills(sb)):
            # (the count says the limit fired, not whom it chose last: host root may have sent this one)
            how = f"killed by signal 9, the OOM killer having fired {ooms} time(s) at its memory limit"
        else:
            how = f"killed by signal {os.WTERMSIG(status)}"
        self.died(sb.spec.id, f"its init ended ({how})")

    async def _launch(self, spec: SandboxSpec) -> Running:
        layers: list[Path] = []
        groups: dict[str, Path] | None = None
        sub: Path | None = None
        init: tuple[int, asyncio.Future] | None = None
        ids: idmap.IdRange | None = None
        end = None
        try:
            end = await self.attach_network(spec)
            if end is not None:      # its commands find the proxy by HTTP(S)_PROXY too
                spec = dataclasses.replace(spec, env={**self.network.sandbox_env(end), **spec.env})
            ids = self._ids.lease(spec.id)
            layers = self._layers.acquire(spec.layers)
            sub = self._uppers.create(spec.id, spec.limits.disk)
            groups = await self._cgroups.create_sandbox_off_loop(spec.id, spec.limits, self._io_device)
            lowers = [str(p) for p in reversed(layers)] or [str(self._empty)]
            ready_r, ready_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
            try:
                msg = Launch(hostname=spec.id, cgroups=[str(p) for p in groups.values()], lowers=lowers,
                             upper=str(sub / "upper"), work=str(sub / "work"), merged=str(sub / "merged"),
                             trusted=str(self._trusted), uid_base=ids.base, empty=str(self._empty),
                             devices=str(self._devices), sysfs=str(self._sysfs), shm=str(sub / "shm"),
                             base=str(self.state_dir), views=self._views.proc_dir, scratch=spec.scratch,
                             netns=end is not None, etc=self.network.sandbox_etc(end) if end else {},
                             idle=spec.limits.cpu_class == "batch")
                try:
                    init = await self._launcher.request(msg, [ready_w] + ([end.netns] if end else []))
                finally:
                    os.close(ready_w)
                error = await asyncio.wait_for(execio.read_to_eof(ready_r), LAUNCH_TIMEOUT)
            finally:
                os.close(ready_r)
            if error:
                raise BackendError(f"sandbox {spec.id} failed to start: {error.decode(errors='replace')}")
            if end is not None:      # its policy went to the proxy while it started
                await self.network_in_force(spec)
            return Running(spec, init[0], init[1], layers, ids, pidfd=os.pidfd_open(init[0]))
        except BaseException as exc:
            await self._teardown(spec.id, init, groups, sub is not None, layers, ids)
            if end is not None:
                await self.network.detach(spec.id)
            if isinstance(exc, LayerError):
                raise LayerUnusable(f"sandbox {spec.id}: {exc}") from exc
            if isinstance(exc, LauncherError) and nskeeper.USERNS_EXHAUSTED in str(exc):
                raise CapacityExhausted(f"sandbox {spec.id}: {exc}") from exc
            if isinstance(exc, asyncio.TimeoutError):   # (an OSError too: first, or its text is '')
                raise BackendError(f"sandbox {spec.id} did not start within {LAUNCH_TIMEOUT:.0f}s") from exc
            if isinstance(exc, (UpperError, CgroupError, LauncherError, OSError)):
                raise BackendError(f"sandbox {spec.id}: {exc}") from exc
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
        hostsfile.name_host(f"/proc/{sb.init_pid}/root", spec.id, sb.ids.base)   # (no command ran in it yet)
        self._sandboxes[spec.id] = self._sandboxes.pop(warm_id)
        sb.spec = spec
        self._keys[spec.id] = sb.key
        while len(self._keys) > KEYS_KEPT:
            self._keys.popitem(last=False)

    def _set_hostname(self, sb: Running, name: str) -> None:
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

    async def destroy(self, sandbox_id: str) -> None:
        """Kill every process, remove cgroups and the writable layer, release layers. Idempotent."""
        sb = self._sandboxes.get(sandbox_id)
        if sb is None:
            raise SandboxGone(f"no such sandbox: {sandbox_id}")
        if sb.dying is None:
            sb.dying = asyncio.ensure_future(self._destroy(sb))
        await asyncio.shield(sb.dying)

    async def _destroy(self, sb: Running) -> None:
        try:
            if sb.resident is not None:   # first: it holds the sandbox's namespaces
                await sb.resident.stop()
            groups = self._cgroups.sandbox(sb.key)
            released: list[bool] = []
            residue = await self._teardown(sb.key, (sb.init_pid, sb.init_exit), groups, True, sb.layers, sb.ids,
                                           released)
            if self.network is not None:
                await self.network.detach(sb.spec.id)
        finally:
            self._sandboxes.pop(sb.spec.id, None)
            sb.close_files()
            if sb.pidfd >= 0:
                os.close(sb.pidfd)
                sb.pidfd = -1
        if residue and residue[0].startswith("processes survive"):
            # Killed, but not gone within kill_tree's 10 s (a machine at load 70, tasks in uninterruptible I/O):
            # no command of the sandbox runs again, so its destroy is done for its user; the node finishes the
            # teardown (groups, upper, uid range) behind it (it failed the destroy and left them until a restart).
            if released and len(residue) == 1:   # gone while their groups were removed: nothing is left
                log.info("destroy %s: its killed processes took over %.0f s to go", sb.spec.id, cgroups.KILL_TIMEOUT)
                return
            log.warning("destroy %s: %s; finishing its teardown in the background", sb.spec.id, "; ".join(residue))
            self._drains.add(asyncio.ensure_future(   # (a uid range handed back already is never handed back again)
                self._finish_later(sb.spec.id, sb.key, groups, None if released else sb.ids)))
        elif residue:
            raise BackendError(f"destroy {sb.spec.id} left: {'; '.join(residue)}")

    async def _finish_later(self, sandbox_id: str, key: str, groups: dict[str, Path], ids) -> None:
        """Tear down again what a destroy left (its processes killed, not yet gone) until nothing is left,
        for up to FINISH_RETRIES' sum of seconds; then what stays is logged, for the next start to reconcile."""
        residue: list[str] = []
        try:
            for delay in FINISH_RETRIES:
                await asyncio.sleep(delay)
                residue = await self._teardown(key, None, groups, True, [], ids)
                if not residue:
                    log.info("destroy %s: teardown finished in the background", sandbox_id)
                    return
            log.error("destroy %s left for good: %s", sandbox_id, "; ".join(residue))
        finally:
            self._drains.discard(asyncio.current_task())

    async def _teardown(self, key: str, init: tuple[int, asyncio.Future] | None,
                        groups: dict[str, Path] | None,
                        upper: bool, layers: list[Path], ids: idmap.IdRange | None = None,
                        released: list[bool] | None = None) -> list[str]:
        """Undo a (partial) launch in reverse order; return what could not be removed. The uid range goes
        back only when every process is gone (else it stays leased: a leftover keeps its identity); when it
        went back, True is appended to `released`."""
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
            if ids is not None and (gone or not groups):
                if released is not None:
                    released.append(True)
                if not self._ids.release(ids):
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
