"""A container's /etc/hosts names its hostname at 127.0.1.1, as Debian's installer writes it, so that sudo,
`hostname -i` and programs that resolve their own name find it (the agent's name_host does the same in a
gVisor sandbox or a VM). The image's other lines stay; a 127.0.1.1 line is replaced.

Best effort, as the agent's: an /etc or /etc/hosts that is a symlink (the image's own choice), a file past
16 KiB, a read-only root or any other failure leaves the file as it is (the sandbox starts all the same).
Paths are opened under a root's fd, one component at a time, never through a symlink: the same code serves
the zygote's child (its own root) and a warm claim (the sandbox's root through /proc/<init>/root, from the
edge, as host root)."""
from __future__ import annotations

import contextlib
import errno
import os
import stat

ADDRESS = b"127.0.1.1"
PLAIN = b"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
MAX_BYTES = 16384


def with_name(old: bytes | None, hostname: str) -> bytes | None:
    """The file's new text (None: leave it): old's lines but a 127.0.1.1 one, then hostname's line."""
    if old is None:
        old = PLAIN
    if len(old) >= MAX_BYTES:
        return None
    kept = [line for line in old.splitlines()
            if not (line.startswith(ADDRESS) and line[len(ADDRESS):len(ADDRESS) + 1] in (b" ", b"\t"))]
    return b"".join(line + b"\n" for line in kept) + ADDRESS + b"\t" + hostname.encode() + b"\n"


def name_host(root: str, hostname: str, owner: int) -> bool:
    """Rewrite <root>/etc/hosts to name hostname, owned by owner (uid and gid); True if it was written."""
    flags = os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        top = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        etc = os.open("etc", os.O_PATH | os.O_DIRECTORY | flags, dir_fd=top)
    except OSError:
        os.close(top)
        return False
    os.close(top)
    try:
        try:
            fd = os.open("hosts", os.O_RDONLY | os.O_NONBLOCK | flags, dir_fd=etc)   # (a FIFO: no wait)
        except FileNotFoundError:
            old = None
        else:
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return False
                old = f.read(MAX_BYTES)
        text = with_name(old, hostname)
        if text is None:
            return False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(".hosts.dsec", dir_fd=etc)     # a crashed write's
        fd = os.open(".hosts.dsec", os.O_WRONLY | os.O_CREAT | os.O_EXCL | flags, 0o644, dir_fd=etc)
        try:
            if os.write(fd, text) != len(text):
                raise OSError(errno.ENOSPC, "short write")
            os.fchown(fd, owner, owner)
            os.fchmod(fd, 0o644)
        finally:
            os.close(fd)
        os.rename(".hosts.dsec", "hosts", src_dir_fd=etc, dst_dir_fd=etc)
        return True
    except OSError:      # whatever the image holds there (a directory named .hosts.dsec, a full layer):
        with contextlib.suppress(OSError):     # the sandbox starts without the line, never fails for it
            os.unlink(".hosts.dsec", dir_fd=etc)
        return False
    finally:
        os.close(etc)
