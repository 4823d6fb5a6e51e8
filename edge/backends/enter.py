"""Spawning a command into a running sandbox straight from the edge, with the dsec-enter helper.

posix_spawn (vfork + exec) is safe in a multithreaded process, unlike fork, so the edge itself can
be the command's parent: no round trip through the zygote, one process hop less each way. The
edge thread points its pid_for_children at the sandbox's pid namespace for the duration of the
spawn only (setns of CLONE_NEWPID is per thread and allowed with threads), so the command lives
inside the sandbox's pid namespace. Its exit is watched with a pidfd; the edge reaps only the
pids it spawned (waitpid of a specific pid), never waitpid(-1).
"""
from __future__ import annotations

import asyncio
import errno
import os
import signal

from edge.backends import kernel

NAMESPACES = ("ipc", "uts", "net", "mnt")
SIGDEF = (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGPIPE,
          signal.SIGXFSZ, signal.SIGUSR1, signal.SIGUSR2)


class Spawner:
    """Spawns dsec-enter from the calling (event loop) thread."""

    def __init__(self, helper: str, keep_mask: int) -> None:
        self.helper = helper
        self.keep_mask = keep_mask
        self.own_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)

    def close(self) -> None:
        """Release the namespace fd."""
        os.close(self.own_pidns)

    def spawn(self, init_pid: int, pidfd: int, tasks: list[str], argv: list[str], env: dict[str, str], cwd: str,
              stdio: list[int], err_w: int) -> int:
        """Start argv in the sandbox whose init is init_pid (pinned by pidfd); returns the host pid."""
        opened: list[int] = []
        try:
            pidns = os.open(f"/proc/{init_pid}/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
            opened.append(pidns)
            for ns in NAMESPACES:
                opened.append(os.open(f"/proc/{init_pid}/ns/{ns}", os.O_RDONLY | os.O_CLOEXEC))
            opened.append(os.open(f"/proc/{init_pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
            if not alive(pidfd):   # the pid was reused after the init died: these are not its namespaces
                raise ProcessLookupError(errno.ESRCH, "sandbox init is gone")
            # dsec-enter's layout above BASE: stdio copies, error pipe, ipc/uts/net/mnt, root. BASE is
            # above every source fd, so no dup2 clobbers a source; then the stdio copies go to 0-2.
            srcs = [*stdio, err_w, *opened[1:]]
            base = max(srcs) + 1
            actions = [(os.POSIX_SPAWN_DUP2, src, base + i) for i, src in enumerate(srcs)]
            actions += [(os.POSIX_SPAWN_DUP2, base + i, i) for i in range(3)]
            args = [self.helper, str(base), hex(self.keep_mask), cwd, *tasks, "--", *argv]
            kernel.setns(pidns, kernel.CLONE_NEWPID)
            try:
                # setsid: its own session with no controlling tty, so kill(0) inside the sandbox or
                # /dev/tty can never reach the edge's process group or the operator's terminal.
                return os.posix_spawn(self.helper, args, env, file_actions=actions, setsigmask=(),
                                      setsigdef=SIGDEF, setsid=True)
            finally:
                kernel.setns(self.own_pidns, kernel.CLONE_NEWPID)
        finally:
            for fd in opened:
                os.close(fd)


def alive(pidfd: int) -> bool:
    """Whether the process behind a pidfd still runs (a pidfd never refers to a reused pid)."""
    try:
        signal.pidfd_send_signal(pidfd, 0)
        return True
    except ProcessLookupError:
        return False


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
