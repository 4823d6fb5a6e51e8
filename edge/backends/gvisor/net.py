"""A gVisor sandbox's network (aether/, through the backends' one hook): the sandbox's network end from the
node's Aether, whose namespace runsc is told to use (the OCI spec's network path). runsc then runs its own
network stack (netstack, `--network=sandbox`) in the sentry: it takes eth0's address and routes, strips them
from the host's kernel and sends its frames through a packet socket on eth0, so they meet the host's rules
on the veth as a container's packets do (the same proxy, resolver, shaping and reverse-path check).

Debian's runsc (2022) decides whether a namespace is the host's by whether /proc/sys/net/core/rmem_default
exists in it, which it does in every namespace since Linux 6.x; it would refuse every sandbox's. runsc is
therefore started in a mount namespace of its own where that directory of the sandbox's namespace is
covered by an empty read-only tmpfs (launch_prep): nothing else of the host changes, and the sentry sets up
its own /proc anyway. That namespace also holds a second, uncovered proc mount: gofer and sandbox mount a
proc in their user namespaces, which the kernel allows only while some proc mount is fully visible (no
covered directory)."""
from __future__ import annotations

import os
import stat

from edge.backends import kernel
from edge.backends.kernel import enter_class
from edge.backends.gvisor.host import _join

CORE_SYSCTLS = "/proc/sys/net/core"
IN_ROOT = kernel.RESOLVE_IN_ROOT | kernel.RESOLVE_NO_MAGICLINKS | kernel.RESOLVE_NO_XDEV


def netns_path(netns_fd: int) -> str:
    """The spec's path of a namespace the edge holds open (runsc, root on the host, opens it by it)."""
    return f"/proc/{os.getpid()}/fd/{netns_fd}"


def launch_prep(tasks: list[str], netns: int, home: int, visible_proc: str, cpu_class: str = "latency") -> None:
    """In the forked runsc, before exec: join the sandbox's cgroups; with a network, enter a mount namespace
    of its own, mount a whole proc on visible_proc (an empty directory) and cover /proc/sys/net/core of the
    sandbox's network namespace (see the module's text). setns moves this (single-threaded) child only; it
    returns to home, the host's network namespace."""
    _join(tasks)
    enter_class(cpu_class)                # sentry, gofer and every sandbox task inherit it
    if netns < 0:
        return
    kernel.unshare(kernel.CLONE_NEWNS)
    kernel.mount(None, "/", None, kernel.MS_REC | kernel.MS_PRIVATE)
    kernel.mount("proc", visible_proc, "proc", 0)
    kernel.setns(netns, kernel.CLONE_NEWNET)
    try:
        kernel.mount("dsec-net-core", CORE_SYSCTLS, "tmpfs",
                     kernel.MS_RDONLY | kernel.MS_NOSUID | kernel.MS_NODEV | kernel.MS_NOEXEC, "size=4k,mode=555")
    finally:
        kernel.setns(home, kernel.CLONE_NEWNET)


def write_etc(root: int, files: dict[str, str], owner: int) -> None:
    """The files of a sandbox's /etc (resolv.conf, the mirrors' config) in its root, before it boots:
    resolved inside the root (a planted symlink cannot lead out), owned by the sandbox's root; a file in a
    subdirectory only where the image has that directory (apt's config where there is apt). The sandbox's
    root may change them later, which gains it nothing: its packets meet the host's rules whatever they
    name."""
    for name, text in files.items():
        parts = name.split("/")
        if not name or any(not part or part.startswith(".") for part in parts):
            raise ValueError(f"not a file name under /etc: {name!r}")
        try:
            fd = kernel.openat2(root, "/etc/" + "/".join(parts[:-1]), os.O_PATH | os.O_DIRECTORY, 0, IN_ROOT)
        except OSError:
            continue                      # no /etc (or no such subdirectory) in this image
        try:
            if stat.S_ISLNK(os.stat(parts[-1], dir_fd=fd, follow_symlinks=False).st_mode):
                os.unlink(parts[-1], dir_fd=fd)
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)
        kernel.write_in_root(root, f"/etc/{name}", text.encode(), 0o644, owner)
