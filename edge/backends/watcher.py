"""Watching a directory of a sandbox from the edge (files.watch / E2B's watch_dir): inotify on the directory
resolved inside the sandbox's root, its events handed to the exec sink as JSON lines.

The directory is opened as treeops opens any path (openat2 RESOLVE_IN_ROOT | NO_XDEV | NO_MAGICLINKS) and
watched through its fd's /proc/self/fd link, so a planted symlink never leads the watch out of the root.
Recursive watches add each subdirectory the same way, relative to its parent's fd without following a
symlink, when the watch starts and when one is made or moved in. What a new directory already holds when its
watch is added (made before inotify could see it) is reported as created, and the one inotify create that
may still come for such an entry is dropped. A watch holds at most MAX_DIRS
directories; a sandbox runs at most PER_SANDBOX at once and the edge MAX_WATCHES. Each watch's inotify
instance is made as the sandbox's host uid (its range base, idmap.py), so it and its watches count against
that uid's inotify limits, shared with the sandbox's own processes (its user namespace is owned by that uid):
made as the edge's, they were host root's, and 128 watches used up every instance root may hold.
Event names are relative to the watched directory; types follow E2B (fsnotify): create, write, remove,
rename, chmod. A full inotify queue is reported once as an `overflow` event (events were lost).
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import errno
import os
import struct
import time
from typing import Callable

import msgspec

from bus.messages import FileEvent as Event
from edge.backends import fscreds
from edge.backends.base import BackendError, ExecControl, ExecResult, OutputSink
from edge.backends.execio import wait_fd, wait_unfrozen
from edge.backends.treeops import wire_name

MAX_DIRS = 4096        # directories one recursive watch follows
MAX_WATCHES = 1024     # watches an edge runs at once
PER_SANDBOX = 16       # watches one sandbox runs at once
BATCH = 64 << 10       # bytes of events read at once

IN_MODIFY, IN_ATTRIB, IN_CLOSE_WRITE = 0x2, 0x4, 0x8
IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x40, 0x80, 0x100, 0x200
IN_DELETE_SELF, IN_MOVE_SELF = 0x400, 0x800
IN_Q_OVERFLOW, IN_IGNORED, IN_ONLYDIR, IN_EXCL_UNLINK, IN_ISDIR = 0x4000, 0x8000, 0x1000000, 0x4000000, 0x40000000
IN_NONBLOCK, IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC
MASK = (IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF
        | IN_MOVE_SELF | IN_ONLYDIR | IN_EXCL_UNLINK)   # (no IN_DONT_FOLLOW: the fd's /proc link is followed)
TYPES = ((IN_CREATE, "create"), (IN_MOVED_TO, "create"), (IN_MODIFY, "write"), (IN_DELETE, "remove"),
         (IN_MOVED_FROM, "rename"), (IN_ATTRIB, "chmod"))
HEAD = struct.Struct("iIII")   # wd, mask, cookie, len

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_running = 0
_owners: dict[int, int] = {}   # host uid -> its watches running


def running() -> int:
    """Watches running on this edge now."""
    return _running


def leaks() -> list[str]:
    """Watches still running, for a backend's leaks() while it holds no sandbox."""
    return [f"{_running} directory watches running"] if _running else []


_encode = msgspec.json.Encoder().encode


def _check(ret: int, what: str) -> int:
    if ret < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
    return ret


class Watch:
    """The inotify instance of one watch of `base`: wd -> the directory's path relative to base. opener(path)
    gives an O_PATH fd of a sandbox path resolved inside its root (held only while its watch is added: a
    held fd would keep the sandbox's mounts busy)."""

    def __init__(self, opener: Callable[[str], int], base: str, recursive: bool, owner: int) -> None:
        self.fd = -1
        self.owner = owner   # the host uid its inotify instance is charged to
        self.opener, self.base, self.recursive = opener, base.rstrip("/") or "/", recursive
        self.dirs: dict[int, str] = {}
        self.seen: set[str] = set()   # entries reported as found in a new directory, whose create may follow
        self.leaving: tuple[int, str] | None = None   # (cookie, path) of a directory moved away, till its arrival

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def start(self) -> None:
        """Watch base (BackendError when it is no directory of the sandbox), and, recursive, what is below.
        In a thread of its own: the inotify instance is made with this thread's effective uid the owner's."""
        self.fd = _inotify_as(self.owner)
        try:
            fd = self.opener(self.base)
        except OSError as exc:
            raise BackendError({errno.ENOENT: f"no such directory: {self.base}",
                                errno.ENOTDIR: f"not a directory: {self.base}"}.get(
                                    exc.errno, f"cannot watch {self.base}: {exc.strerror}")) from None
        try:
            self._add(fd, "")
        finally:
            os.close(fd)

    def _add(self, dir_fd: int, rel: str, found: list[Event] | None = None) -> None:
        """Watch the directory open at dir_fd; recursive, every directory below it too (each opened relative
        to its parent, never through a symlink; depth first, without recursion: any depth). found: a create
        event is added to it for every entry below (listed after its directory's watch is in place)."""
        self._watch(dir_fd, rel)
        if not self.recursive:
            return
        todo = [(os.dup(dir_fd), rel)]
        try:
            while todo:
                fd, at = todo.pop()
                try:
                    with contextlib.suppress(OSError):   # a directory gone meanwhile: its events end there
                        for name in os.listdir(f"/proc/self/fd/{fd}"):
                            path = f"{at}/{name}" if at else name
                            if found is not None:
                                found.append(Event("create", path))
                                self.seen.add(path)
                            try:
                                sub = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                                              dir_fd=fd)
                            except OSError:
                                continue   # not a directory (a symlink to one is not followed), or gone
                            try:
                                self._watch(sub, path)
                            except BaseException:
                                os.close(sub)
                                raise
                            todo.append((sub, path))
                finally:
                    os.close(fd)
        finally:
            for fd, _ in todo:
                os.close(fd)

    def _watch(self, dir_fd: int, rel: str) -> None:
        if len(self.dirs) >= MAX_DIRS:
            raise BackendError(f"a watch follows at most {MAX_DIRS} directories")
        try:
            wd = _check(_libc.inotify_add_watch(self.fd, f"/proc/self/fd/{dir_fd}".encode(), MASK), "inotify_add_watch")
        except OSError as exc:   # ENOSPC: the owner's inotify watches are used up
            raise BackendError(f"cannot watch {self.base}/{rel}: {exc.strerror}") from None
        self.dirs[wd] = rel

    def events(self, data: bytes) -> list[Event]:
        """The events in one read, as lines to hand out; new directories are watched (recursive)."""
        out: list[Event] = []
        at = 0
        while at + HEAD.size <= len(data):
            wd, mask, cookie, size = HEAD.unpack_from(data, at)
            name = data[at + HEAD.size:at + HEAD.size + size].split(b"\0", 1)[0].decode(errors="surrogateescape")
            at += HEAD.size + size
            if self.leaving is not None and not (mask & IN_MOVED_TO and cookie == self.leaving[0]):
                self._forget(self.leaving[1])   # (the kernel queues a move's arrival right after its departure)
                self.leaving = None
            if mask & IN_Q_OVERFLOW:
                out.append(Event("overflow"))
                continue
            rel = self.dirs.get(wd)
            if rel is None:
                continue
            if mask & IN_IGNORED:
                self.dirs.pop(wd, None)
                continue
            if mask & (IN_DELETE_SELF | IN_MOVE_SELF):
                if not rel:   # the watched directory itself went: reported once, then the watch ends
                    out.append(Event("remove" if mask & IN_DELETE_SELF else "rename", ""))
                    self.dirs.clear()
                continue
            if not name:   # about a directory itself (its mode): its parent's watch reports it, under its name
                continue
            path = f"{rel}/{name}" if rel else name
            if path in self.seen:
                self.seen.discard(path)   # reported already, as found in its new directory: this create was it
                if mask & (IN_CREATE | IN_MOVED_TO):
                    continue
            for bit, kind in TYPES:
                if mask & bit:
                    out.append(Event(kind, path))
                    break
            if self.recursive and mask & IN_ISDIR:
                if mask & IN_MOVED_FROM:
                    self.leaving = (cookie, path)
                elif mask & IN_MOVED_TO and self.leaving is not None and self._renamed(self.leaving[1], path):
                    self.leaving = None
                elif mask & (IN_CREATE | IN_MOVED_TO):
                    self.leaving = None
                    out += self._add_new(path)
        return out

    def _under(self, path: str) -> list[int]:
        return [wd for wd, rel in self.dirs.items() if _inside(rel, path)]

    def _renamed(self, old: str, new: str) -> bool:
        """A directory moved within the tree: what the watch follows of it is named by its new path (looked up
        by nothing on disk: it may have moved on again by now, and its later events are named by the move
        that comes next). False when the watch did not follow it yet (its arrival is then added as new)."""
        wds = self._under(old)
        if not wds:
            return False
        for wd in wds:
            self.dirs[wd] = new + self.dirs[wd][len(old):]
        self.seen = {new + p[len(old):] if _inside(p, old) else p for p in self.seen}
        return True

    def _forget(self, path: str) -> None:
        """A directory moved out of the tree: nothing in it is reported any more (it was, under its old path)."""
        for wd in self._under(path):
            _libc.inotify_rm_watch(self.fd, wd)
            del self.dirs[wd]
        self.seen = {p for p in self.seen if not _inside(p, path)}

    def _add_new(self, path: str) -> list[Event]:
        """A directory made or moved in below a watched one: watched too (past MAX_DIRS, or gone: not); a
        create event for each entry it already holds."""
        found: list[Event] = []
        with contextlib.suppress(OSError, BackendError):
            fd = self.opener(f"{self.base.rstrip('/')}/{path}")
            try:
                self._add(fd, path, found)
            finally:
                os.close(fd)
        return found


def _inside(rel: str, root: str) -> bool:
    """Whether a path relative to the watch is root or below it."""
    return rel == root or rel.startswith(root + "/")


def _inotify_as(uid: int) -> int:
    """A new inotify instance charged to host uid `uid` (made as it: fscreds.as_euid)."""
    try:
        with fscreds.as_euid(uid):
            fd = _libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
            e = ctypes.get_errno()
    except OSError as exc:
        raise BackendError(f"cannot watch: {exc.strerror}") from None
    if fd < 0:
        raise BackendError(f"cannot watch: inotify_init1: {os.strerror(e)} (the sandbox's own processes and its "
                           "watches share the host's fs.inotify.max_user_instances)")
    return fd


async def watch(opener: Callable[[str], int], path: str, recursive: bool, timeout: float, sink: OutputSink,
                control: ExecControl | None, frozen_for=lambda: 0.0, *, owner: int) -> ExecResult:
    """Hand the directory's events to sink (stdout, a JSON line each) until control's signal, the timeout
    (timed_out) or the directory's end; its ExecResult (exit 0 when the directory went, 128+signal when
    stopped). owner: the sandbox's host uid, charged with the watch's inotify instance and watches."""
    global _running
    if _running >= MAX_WATCHES:
        raise BackendError(f"this node runs its limit of {MAX_WATCHES} directory watches")
    if _owners.get(owner, 0) >= PER_SANDBOX:
        raise BackendError(f"this sandbox runs its limit of {PER_SANDBOX} directory watches")
    started = time.monotonic()
    w = Watch(opener, path, recursive, owner)
    _running += 1
    _owners[owner] = _owners.get(owner, 0) + 1
    try:
        starting = asyncio.ensure_future(asyncio.to_thread(w.start))
        try:
            await asyncio.shield(starting)
        except asyncio.CancelledError:   # its thread goes on: wait for it, so the fd it makes is closed below
            await asyncio.gather(starting, return_exceptions=True)
            raise
        stopped = asyncio.get_running_loop().create_future()

        async def stop(sig: int) -> bool:
            if stopped.done():
                return False
            stopped.set_result(sig)
            return True
        if control is not None:
            control.on_signal(stop)
            await control.started(0)   # the watch is in place: files.watch() returns now
        turn = asyncio.Lock()   # one reader of the inotify fd and writer of the sink at a time
        pump = asyncio.ensure_future(_pump(w, sink, stopped, turn))
        marks = asyncio.ensure_future(_marks(w, sink, control, turn)) if control is not None else None
        timed_out = False
        try:
            await wait_unfrozen(pump, timeout, frozen_for)
        except asyncio.TimeoutError:
            timed_out = True
        finally:
            for task in (pump, marks):
                if task is not None:
                    task.cancel()
            await asyncio.gather(*(t for t in (pump, marks) if t is not None), return_exceptions=True)
        if not timed_out and not pump.cancelled() and pump.exception() is not None:
            raise pump.exception()  # type: ignore[misc]
        sig = stopped.result() if stopped.done() else 0
        return ExecResult(exit_code=128 + (9 if timed_out else sig) if timed_out or sig else 0,
                          duration=time.monotonic() - started, cpu_time=0.0, peak_memory=0, timed_out=timed_out)
    finally:
        _running -= 1
        _owners[owner] -= 1
        if not _owners[owner]:
            del _owners[owner]
        w.close()


async def _pump(w: Watch, sink: OutputSink, stopped: asyncio.Future, turn: asyncio.Lock) -> None:
    while not stopped.done() and w.dirs:   # (no dirs: the directory is gone, or its filesystem unmounted)
        reading = asyncio.ensure_future(wait_fd(w.fd))
        try:
            await asyncio.wait([reading, stopped], return_when=asyncio.FIRST_COMPLETED)
        finally:   # (cancelled too: a wait left pending kept the fd registered and was destroyed pending)
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
        async with turn:
            await _drain(w, sink)


async def _drain(w: Watch, sink: OutputSink, then: list[Event] | None = None) -> None:
    """Hand out every event queued now (then the events in `then`)."""
    lines: list[Event] = []
    while True:
        try:
            data = os.read(w.fd, BATCH)
        except BlockingIOError:
            break
        lines += w.events(data)
    w.seen.clear()   # any create queued before a new directory's listing has been read by now
    lines += then or []
    if lines:
        await sink("stdout", b"".join(_encode(Event(e.type, wire_name(e.name))) + b"\n" for e in lines))


async def _marks(w: Watch, sink: OutputSink, control: ExecControl, turn: asyncio.Lock) -> None:
    """Each piece written to the watch's stdin (files.watch's flush) comes back as a `mark` event named by it,
    after every event queued when it came: the client then knows it has all that happened before."""
    while True:
        data, done = await control.next_input()
        if data is not None:
            async with turn:
                await _drain(w, sink, [Event("mark", data.decode(errors="replace")[:64])])
        done.set_result(True)
