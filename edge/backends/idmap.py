"""Host identities of sandboxes: each sandbox's root is an unprivileged host uid/gid range of its own.

A sandbox's uid 0..65535 is host BASE + 65536*i .. + 65535, where range i is leased host-wide: the
lease is a file `<LEASES>/<i>` created with O_EXCL, so several edges on one machine (each with its own
node id and state dir) never share a range, and a restarted edge finds its own. Per-user kernel limits
(inotify, keys, user namespaces, RLIMIT_NPROC), file ownership and capabilities are then per sandbox,
and nothing a sandbox writes is owned by a privileged host uid.

A range is given back only once nothing is charged to it any more: the sandbox's cgroups are empty
(every process gone, so their inotify instances and the user namespaces they pinned too) and the
kernel holds no key of any uid in it (/proc/key-users). A range still holding keys stays leased
("draining") and is looked at again on later allocations, so a later sandbox never reads a key left
by an earlier one.

LEASES lives under /run (tmpfs): it survives edge restarts, and a host reboot ends every process
charged to a range anyway.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import random
import subprocess
import time
from dataclasses import dataclass

from edge.backends.base import CapacityExhausted

BASE = 1 << 28                  # 268435456: far above login users and /etc/subuid's usual 100000+
SIZE = 1 << 16                  # ids per sandbox: every uid an image's files may use
COUNT = ((1 << 31) - BASE) // SIZE   # 28672 ranges, all below 2^31 (tools that take uids as signed)
LEASES = os.environ.get("DSEC_UID_LEASES", "/run/dsec/uid-leases")
DRAINING = "draining"


class RangesExhausted(CapacityExhausted):
    """No uid range is free on this host (every one leased or still holding kernel objects)."""


@dataclass(frozen=True)
class IdRange:
    """One sandbox's host ids: sandbox uid/gid n is host `base + n`."""

    index: int

    @property
    def base(self) -> int:
        return BASE + self.index * SIZE

    def map_line(self) -> str:
        """uid_map/gid_map text mapping sandbox 0..SIZE-1 onto this range."""
        return f"0 {self.base} {SIZE}"

    def holds(self, host_id: int) -> bool:
        return self.base <= host_id < self.base + SIZE


class Allocator:
    """Leases ranges for one node; `count` limits the ranges it may try (tests shrink it)."""

    def __init__(self, node_id: str, *, leases: str = LEASES, count: int = COUNT) -> None:
        self.node_id = node_id
        self.dir = leases
        self.count = count
        self._hint = random.randrange(count)   # edges start at different places: fewer collisions
        self._freed: list[int] = []            # ranges this node gave back, newest last: tried first (the
                                               # zygote keeps each range's user namespace for its next use)
        self._drained: list[int] = []          # ranges this node left draining (keys not yet collected)

    def setup(self) -> None:
        """Create the lease dir (0700: only root reads who holds what)."""
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        os.chmod(self.dir, 0o700)

    def lease(self, key: str) -> IdRange:
        """A free range, leased to key of this node. RangesExhausted when none is."""
        body = f"{self.node_id}\t{key}\n".encode()
        while self._freed:
            i = self._freed.pop()
            if self._take(i, body):
                return IdRange(i)
        for i in self._drained[-4:]:   # an exec's session keyring is collected just after its sandbox ends
            if self._take_drained(i, body):
                self._drained.remove(i)
                return IdRange(i)
        for step in range(self.count):
            i = (self._hint + step) % self.count
            if self._take(i, body) or (self._draining(i) and self._take_drained(i, body)):
                self._hint = (i + 1) % self.count
                return IdRange(i)
        raise RangesExhausted(f"no free uid range on this host (all {self.count} leased or holding keys)")

    def _take(self, i: int, body: bytes) -> bool:
        try:
            fd = os.open(self._path(i), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            return False
        try:
            os.write(fd, body)
        finally:
            os.close(fd)
        return True

    def _take_drained(self, i: int, body: bytes) -> bool:
        """A draining range whose keys are gone, leased to us (under the host-wide drain lock)."""
        with self._drain_lock():
            if not self._draining(i) or charged(IdRange(i)):
                return False
            self._write(i, body)
            return True

    def release_drained(self, rng: IdRange) -> bool:
        """Give back a range this node left draining, once its keys are gone; False if it still holds
        some, or is no longer ours (another edge took it after its keys went)."""
        with self._drain_lock():
            if not self.draining_ours(rng) or charged(rng):
                return False
            os.unlink(self._path(rng.index))
        if rng.index in self._drained:
            self._drained.remove(rng.index)
        self._note_freed(rng)
        return True

    def draining_ours(self, rng: IdRange) -> bool:
        """Whether the range is still leased to this node, draining (one lease file read)."""
        return self._owner(rng.index) == (self.node_id, DRAINING)

    def _note_freed(self, rng: IdRange) -> None:
        if len(self._freed) < 4096:
            self._freed.append(rng.index)

    @contextlib.contextmanager
    def _drain_lock(self):
        """flock on <leases>/.lock: taking a draining range and giving one back never interleave."""
        fd = os.open(f"{self.dir}/.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def release(self, rng: IdRange) -> bool:
        """Give a range back once nothing of its sandbox remains (call after its processes are gone).
        A range that still holds keys stays leased, marked draining; returns whether it was freed."""
        if charged(rng):
            self._write(rng.index, f"{self.node_id}\t{DRAINING}\n".encode())
            if rng.index not in self._drained:
                self._drained = [*self._drained[-255:], rng.index]
            return False
        try:
            os.unlink(self._path(rng.index))
        except FileNotFoundError:
            pass
        self._note_freed(rng)
        return True

    def reclaim(self) -> int:
        """After a restart (this node's processes all killed): release this node's leases. Returns how
        many stay leased (draining)."""
        return sum(not self.release(IdRange(i)) for i in self.held())

    def held(self) -> dict[int, str]:
        """This node's leases: range index -> sandbox key (or 'draining')."""
        return {i: key for i, (node, key) in leases(self.dir).items() if node == self.node_id}

    def _draining(self, i: int) -> bool:
        owner = self._owner(i)
        return owner is not None and owner[1] == DRAINING

    def _path(self, i: int) -> str:
        return f"{self.dir}/{i}"

    def _owner(self, i: int) -> tuple[str, str] | None:
        return _read_owner(self._path(i))

    def _write(self, i: int, body: bytes) -> None:
        tmp = f"{self._path(i)}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(body)
        os.replace(tmp, self._path(i))


def leases(leases_dir: str = LEASES) -> dict[int, tuple[str, str]]:
    """Every lease on the host: range index -> (node, sandbox key or 'draining')."""
    out: dict[int, tuple[str, str]] = {}
    for name in os.listdir(leases_dir) if os.path.isdir(leases_dir) else []:
        if name.isdigit():
            owner = _read_owner(f"{leases_dir}/{name}")
            if owner is not None:
                out[int(name)] = owner
    return out


def _read_owner(path: str) -> tuple[str, str] | None:
    try:
        with open(path, "rb") as f:
            node, _, key = f.read(512).decode(errors="replace").rstrip("\n").partition("\t")
    except FileNotFoundError:
        return None
    return node, key


def relative_userns(rng: IdRange) -> int:
    """An fd of a user namespace mapping the range back onto 0..65535 (host base+n shows as n), for an
    idmapped view of a writable layer: what a snapshot packs is then owned relative to the sandbox (its
    root is 0), whatever range or node it is later unpacked into."""
    return userns_with_map(f"{rng.base} 0 {SIZE}")


def forward_userns(base: int) -> int:
    """An fd of a user namespace mapping 0..65535 onto base.. (an idmapped view showing host root's files
    as the sandbox root's: gVisor's layer views)."""
    return userns_with_map(f"0 {base} {SIZE}")


def userns_with_map(line: str) -> int:
    """An fd of a new user namespace whose uid and gid maps are `line`: made by a stub `unshare --user`
    process whose maps we write (the stub runs nothing; it exits when its stdin closes)."""
    stub = subprocess.Popen(["unshare", "--user", "--", "cat"], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        own = os.stat("/proc/self/ns/user").st_ino
        deadline = time.monotonic() + 5
        while os.stat(f"/proc/{stub.pid}/ns/user").st_ino == own:
            if stub.poll() is not None or time.monotonic() > deadline:
                raise OSError(errno.EPERM, "unshare --user did not start")
            time.sleep(0.0005)
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{stub.pid}/{name}", "w") as f:
                f.write(line)
        return os.open(f"/proc/{stub.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        stub.stdin.close()
        stub.wait()


def charged(rng: IdRange) -> bool:
    """Whether the kernel still holds keys (any keyring included) of a uid in the range."""
    try:
        with open("/proc/key-users") as f:
            for line in f:
                uid = line.split(":", 1)[0].strip()
                if uid.isdigit() and rng.holds(int(uid)):
                    return True
    except OSError as exc:
        if exc.errno != errno.ENOENT:    # no keys support: nothing can be charged
            raise
    return False
