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

import asyncio
import errno
import os
import signal

NAMESPACES = ("ipc", "uts", "net", "mnt", "pid", "cgroup", "user")
SIGDEF = (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGPIPE,
          signal.SIGXFSZ, signal.SIGUSR1, signal.SIGUSR2)
SETUP_MAX = 65535       # what dsec-enter reads of its setup (a pipe holds 64 KiB: written before the spawn)


class Spawner:
    """Spawns dsec-enter from the calling (event loop) thread."""

    def __init__(self, helper: str, keep_mask: int) -> None:
        self.helper = helper
        self.keep_mask = keep_mask

    def close(self) -> None:
        """Nothing held (kept for symmetry with start)."""

    def spawn(self, init_pid: int, pidfd: int, tasks: list[str], argv: list[str], env: dict[str, str], cwd: str,
              stdio: list[int], err_w: int, fresh_ipc: bool = False) -> int:
        """Start dsec-enter for argv in the sandbox whose init is init_pid (pinned by pidfd); returns the
        helper's host pid (its wait status is the command's). fresh_ipc: an IPC namespace of its own."""
        mask = hex(self.keep_mask) + (",ipc" if fresh_ipc else "")
        setup = b"\0".join(s.encode() for s in (mask, cwd, *tasks)) + b"\0"
        if len(setup) > SETUP_MAX:
            raise OSError(errno.E2BIG, "exec setup too large (cwd too long)")
        opened: list[int] = []
        try:
            for ns in NAMESPACES:
                opened.append(os.open(f"/proc/{init_pid}/ns/{ns}", os.O_RDONLY | os.O_CLOEXEC))
            opened.append(os.open(f"/proc/{init_pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
            if not alive(pidfd):   # the pid was reused after the init died: these are not its namespaces
                raise ProcessLookupError(errno.ESRCH, "sandbox init is gone")
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
            return os.posix_spawn(self.helper, ["dsec-enter", str(base), "--", *argv], env, file_actions=actions,
                                  setsigmask=(), setsigdef=SIGDEF, setsid=True)
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
