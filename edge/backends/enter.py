"""Starting a command in a running sandbox, from outside its reach, with the dsec-enter helper.

The edge posix_spawns dsec-enter (vfork + exec: safe in a multithreaded process, no copy of the
edge's memory) in the host's pid namespace, so no process of the sandbox can see, stop or open it:
the vfork window in which the child still runs the edge's code and holds the host's namespaces is
out of the sandbox's sight. The helper enters the sandbox itself (see dsec-enter.c), makes the
command's process last, stays its parent (out of sight, every signal blocked) and exits the way the
command did, so the helper's wait status is the command's.

The edge never waits on a child synchronously: the helper's exit is watched through a pidfd on the
event loop; the edge reaps only the pids it spawned (waitpid of a specific pid), never waitpid(-1). The setup (capabilities, cwd, cgroup tasks files) goes on a pipe, not argv,
so the helper's command line shows nothing of the host.
"""
from __future__ import annotations

import array
import asyncio
import contextlib
import errno
import itertools
import os
import signal
import socket
import struct
from typing import NamedTuple

from edge.backends import kernel
from edge.backends.base import BackendError

NAMESPACES = ("ipc", "uts", "net", "mnt", "pid", "cgroup", "user")
SIGDEF = (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGPIPE,
          signal.SIGXFSZ, signal.SIGUSR1, signal.SIGUSR2)
SETUP_MAX = 65535       # the most a setup may hold (a pipe holds 64 KiB: written before the command starts)
COLLECT_MAX = 128 << 10   # the most one collect request may hold (dsec-enter.c's COLLECT_MAX)
COLLECT_HEAD = 24
ANSWER_HEAD = 16          # an answer's header: id u64, kind u32, value i32
ANSWER_MAX = 1 << 17      # the largest answer (a 64 KiB piece of output and its header)
ANS_EXIT, ANS_STDOUT, ANS_STDERR, ANS_END = range(4)


class Collected(NamedTuple):
    """How a collected command ended: its raw wait status, the output kept, whether any was cut at
    the limit, and the error report (empty once execve succeeded)."""

    status: int
    stdout: bytes
    stderr: bytes
    truncated: bool
    report: bytes


class Spawner:
    """Spawns dsec-enter from the calling (event loop) thread."""

    def __init__(self, helper: str, keep_mask: int) -> None:
        self.helper = helper
        self.keep_mask = keep_mask

    def close(self) -> None:
        """Nothing held (kept for symmetry with start)."""

    def start(self, init_pid: int, pidfd: int, tasks: list[str], argv: list[str], env: dict[str, str], cwd: str,
              stdio: list[int], err_w: int, fresh_ipc: bool = False, flags: str = "") -> asyncio.Future:
        """spawn(), and a future of the command's raw wait status (the helper is reaped by it)."""
        return watch_or_kill(self.spawn(init_pid, pidfd, tasks, argv, env, cwd, stdio, err_w, fresh_ipc, flags))

    def spawn(self, init_pid: int, pidfd: int, tasks: list[str], argv: list[str], env: dict[str, str], cwd: str,
              stdio: list[int], err_w: int, fresh_ipc: bool = False, flags: str = "") -> int:
        """Start dsec-enter for argv in the sandbox whose init is init_pid (pinned by pidfd); returns the
        helper's host pid (its wait status is the command's). fresh_ipc: an IPC namespace of its own; flags:
        more setup flags (",idle" for a batch sandbox, a user's: users.ExecUser.flag)."""
        setup = setup_bytes(self.keep_mask, fresh_ipc, cwd, tasks, flags)
        if len(setup) > SETUP_MAX:
            raise OSError(errno.E2BIG, "exec setup too large (cwd too long)")
        opened = open_sandbox(init_pid, pidfd)
        try:
            setup_r, setup_w = os.pipe2(os.O_CLOEXEC)
            opened.append(setup_r)
            try:
                os.write(setup_w, setup)
            finally:
                os.close(setup_w)
            # dsec-enter's layout above BASE: stdio copies, error pipe, ipc/uts/net/mnt/pid/cgroup/user, root,
            # setup. BASE is above every source fd, so no dup2 clobbers a source; then stdio to 0-2.
            srcs = [*stdio, err_w, *opened]
            base = max(srcs) + 1
            actions = [(os.POSIX_SPAWN_DUP2, src, base + i) for i, src in enumerate(srcs)]
            actions += [(os.POSIX_SPAWN_DUP2, base + i, i) for i in range(3)]
            # setsid: its own session with no controlling tty (the command makes its own session too).
            with kernel.on_this_cpu():
                return os.posix_spawn(self.helper, ["dsec-enter", str(base), "--", *argv], env,
                                      file_actions=actions, setsigmask=(), setsigdef=SIGDEF, setsid=True)
        finally:
            for fd in opened:
                os.close(fd)


class Resident:
    """One sandbox's own dsec-enter server (`dsec-enter --serve`, see dsec-enter.c), for fncall workers: a
    command costs the server one clone instead of the edge a posix_spawn of the helper (the event loop's
    largest cost per call) and the helper its way in. The server lives in the host's pid namespace like
    any helper and enters the sandbox once, at its start; every command joins the cgroups of tasks (the
    worker's one exec group, whose tasks files are opened here and held by the server). Started with a
    running loop; close() ends it (the server exits when its socket closes, and is reaped here)."""

    def __init__(self, helper: str, keep_mask: int, init_pid: int, pidfd: int, tasks: list[str]) -> None:
        self.keep_mask = keep_mask
        self.pidfd = pidfd
        self._loop = asyncio.get_running_loop()
        self._waiting: dict[int, asyncio.Future] = {}
        self._collected: dict[int, tuple[bytearray, bytearray]] = {}   # collect id -> stdout, stderr so far
        self._ids = itertools.count(1)
        self.closed = False
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        opened = open_sandbox(init_pid, pidfd)
        null = -1
        try:
            for path in tasks:   # opened as host root: a pid written there joins (cgroup v1 checks the opener)
                opened.append(os.open(path, os.O_WRONLY | os.O_CLOEXEC))
            null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
            srcs = [theirs.fileno(), *opened]
            base = max(*srcs, null) + 1 - 3    # the socket at BASE+3; the namespaces, root and tasks above it
            actions = [(os.POSIX_SPAWN_DUP2, src, base + 3 + i) for i, src in enumerate(srcs)]
            actions += [(os.POSIX_SPAWN_DUP2, null, i) for i in range(3)]
            self.pid = os.posix_spawn(helper, ["dsec-enter", "--serve", str(base), str(len(tasks))], {},
                                      file_actions=actions, setsigmask=(), setsigdef=SIGDEF, setsid=True)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
            if null >= 0:
                os.close(null)
            for fd in opened:
                os.close(fd)
        self._sock = ours
        ours.setblocking(False)
        try:
            self.exited = watch_or_kill(self.pid)
        except OSError:
            ours.close()
            raise
        self._loop.add_reader(ours.fileno(), self._on_answer)

    def start(self, argv: list[str], env: dict[str, str], cwd: str, stdio: list[int], err_w: int,
              fresh_ipc: bool = False) -> asyncio.Future:
        """Run argv through the server; a future of its raw wait status (BackendError if the server dies
        first). OSError: E2BIG when the command does not fit a pipe (the caller spawns it the one-shot
        way), EPIPE when the server is gone (a new one may take it), ESRCH when the sandbox is gone."""
        if self.closed:
            raise OSError(errno.EPIPE, "the sandbox's exec server is gone")
        if not alive(self.pidfd):
            raise ProcessLookupError(errno.ESRCH, "sandbox init is gone")
        setup = _command_setup(self.keep_mask, fresh_ipc, cwd, argv, env)
        if len(setup) > SETUP_MAX:
            raise OSError(errno.E2BIG, "command too large for the exec server")
        setup_r, setup_w = os.pipe2(os.O_CLOEXEC)
        try:
            try:
                os.write(setup_w, setup)
            finally:
                os.close(setup_w)
            n = next(self._ids)
            fds = array.array("i", [*stdio, err_w, setup_r])
            try:
                self._sock.sendmsg([struct.pack("<Q", n)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds.tobytes())])
            except BlockingIOError as exc:   # alive but not reading: this command fails, the others go on
                raise OSError(errno.EAGAIN, "the sandbox's exec server is busy") from exc
            except OSError as exc:   # the server died (its EOF not seen yet)
                self.close()
                raise OSError(errno.EPIPE, f"the sandbox's exec server is gone: {exc.strerror}") from exc
        finally:
            os.close(setup_r)
        fut = self._loop.create_future()
        self._waiting[n] = fut
        return fut

    def collect(self, argv: list[str], env: dict[str, str], cwd: str, stdin: bytes, max_output: int,
                fresh_ipc: bool = False) -> asyncio.Future:
        """Run argv through the server's collect mode (see dsec-enter.c): the server makes the pipes, feeds
        stdin and keeps up to max_output bytes of each stream; a future of its Collected. OSError as for
        start(); E2BIG when the request does not fit one packet (the caller goes the way with pipes)."""
        if self.closed:
            raise OSError(errno.EPIPE, "the sandbox's exec server is gone")
        if not alive(self.pidfd):
            raise ProcessLookupError(errno.ESRCH, "sandbox init is gone")
        setup = _command_setup(self.keep_mask, fresh_ipc, cwd, argv, env)
        if COLLECT_HEAD + len(setup) + len(stdin) > COLLECT_MAX:
            raise OSError(errno.E2BIG, "command too large for one collect request")
        n = next(self._ids)
        try:
            self._sock.sendmsg([struct.pack("<QIIIxxxx", n, 1, max_output, len(stdin)), setup, stdin])
        except BlockingIOError as exc:
            raise OSError(errno.EAGAIN, "the sandbox's exec server is busy") from exc
        except OSError as exc:
            self.close()
            raise OSError(errno.EPIPE, f"the sandbox's exec server is gone: {exc.strerror}") from exc
        fut = self._loop.create_future()
        self._waiting[n] = fut
        self._collected[n] = (bytearray(), bytearray())
        return fut

    def _on_answer(self) -> None:
        while True:
            try:
                msg = self._sock.recv(ANSWER_MAX)
            except BlockingIOError:
                return
            except OSError:
                msg = b""
            if len(msg) < ANSWER_HEAD:   # EOF: the server is gone (killed); the next command gets a new one
                self.close()
                return
            n, kind, value = struct.unpack_from("<QIi", msg)
            if kind in (ANS_STDOUT, ANS_STDERR):
                bufs = self._collected.get(n)
                if bufs is not None:
                    bufs[kind - ANS_STDOUT].extend(memoryview(msg)[ANSWER_HEAD:])
                continue
            fut = self._waiting.pop(n, None)
            bufs = self._collected.pop(n, None)
            if fut is None or fut.done():
                continue
            if kind == ANS_END and bufs is not None:
                flags, out_len, err_len, report_len = struct.unpack_from("<IIII", msg, ANSWER_HEAD)
                at = ANSWER_HEAD + 16
                bufs[0].extend(msg[at:at + out_len])
                bufs[1].extend(msg[at + out_len:at + out_len + err_len])
                at += out_len + err_len
                fut.set_result(Collected(value, bytes(bufs[0]), bytes(bufs[1]), bool(flags & 3),
                                         msg[at:at + report_len]))
            elif value < 0:
                fut.set_exception(BackendError(f"exec server could not start the command: {os.strerror(-value)}"))
            else:
                fut.set_result(value)

    async def stop(self, grace: float = 2.0) -> None:
        """close(), and wait until the server is gone (killed after grace seconds): only then are the
        sandbox's namespaces no longer held by it."""
        self.close()
        try:
            await asyncio.wait_for(asyncio.shield(self.exited), grace)
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            await self.exited

    def close(self) -> None:
        """End the server (it exits at its socket's EOF; reaped through self.exited); what still waits
        for an answer fails."""
        if self.closed:
            return
        self.closed = True
        self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        for fut in self._waiting.values():   # no answer can come any more
            if not fut.done():
                fut.set_exception(BackendError("the sandbox's exec server ended while the command ran"))
        self._waiting.clear()
        self._collected.clear()


def _command_setup(keep_mask: int, fresh_ipc: bool, cwd: str, argv: list[str], env: dict[str, str]) -> bytes:
    """The serve mode's setup: setup_bytes without tasks (the server's own), then "\0ARGC\0ARGV...\0ENV...\0"."""
    return (setup_bytes(keep_mask, fresh_ipc, cwd, []) + b"\0" + str(len(argv)).encode() + b"\0"
            + b"".join(a.encode() + b"\0" for a in argv)
            + b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()))


def setup_bytes(keep_mask: int, fresh_ipc: bool, cwd: str, tasks: list[str], flags: str = "") -> bytes:
    """dsec-enter's setup: "CAPMASK[,ipc][,idle][,u=UID:GID...]\0CWD\0TASKS...\0" (its cgroup tasks files)."""
    mask = hex(keep_mask) + (",ipc" if fresh_ipc else "") + flags
    return b"\0".join(s.encode() for s in (mask, cwd, *tasks)) + b"\0"


def open_sandbox(init_pid: int, pidfd: int) -> list[int]:
    """The namespace fds (NAMESPACES' order) and root of the sandbox whose init is init_pid, checked
    against its pidfd (a reused pid's are not its); ProcessLookupError when it is gone."""
    opened: list[int] = []
    try:
        for ns in NAMESPACES:
            opened.append(os.open(f"/proc/{init_pid}/ns/{ns}", os.O_RDONLY | os.O_CLOEXEC))
        opened.append(os.open(f"/proc/{init_pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
        if not alive(pidfd):
            raise ProcessLookupError(errno.ESRCH, "sandbox init is gone")
    except BaseException:
        for fd in opened:
            os.close(fd)
        raise
    return opened


def alive(pidfd: int) -> bool:
    """Whether the process behind a pidfd still runs (a pidfd never refers to a reused pid)."""
    try:
        signal.pidfd_send_signal(pidfd, 0)
        return True
    except ProcessLookupError:
        return False


def watch_or_kill(pid: int) -> asyncio.Future:
    """watch_exit(pid); if it cannot be watched (out of fds), the child is killed and reaped, not left
    running unwatched, and the OSError raised."""
    try:
        return watch_exit(pid)
    except OSError:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise


def watch_exit(pid: int) -> asyncio.Future:
    """A future for the raw wait status of our child pid (reaped here, through a pidfd)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    pidfd = os.pidfd_open(pid)

    def _ready() -> None:
        loop.remove_reader(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        if not fut.done():
            fut.set_result(status)

    loop.add_reader(pidfd, _ready)
    return fut
