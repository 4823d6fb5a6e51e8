"""Templates: a booted microVM saved once per (guest, layers, size) and restored by every create of that
key, so a create costs a restore (~0.1-0.2 s under TCG) instead of a boot (seconds).

A template is three things:
- its RAM, a sealed memfd: the template VM ran with it as `memory-backend-file,share=on` and
  `x-ignore-shared` kept it out of the migration stream; restores map it `share=off` (copy-on-write), so
  every VM of the key shares the pages it has not written, and F_SEAL_WRITE means neither a restored VM
  nor anybody else can change it (a private mapping of a write-sealed memfd is still writable, privately);
- its device state (the migration stream without RAM, tens of KB), a file QEMU reads through an fd;
- its writable disk as it was when saved (the guest's page cache and mounts refer to it): each restore
  starts on a sparse copy of its own.
What a restored VM gets of its own is done by its agent's wake request (clock, RNG reseed, hostname).
The memfds die with the edge, so a restarted edge rebuilds templates on first use.
"""
from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
KEEP = int(os.environ.get("DSEC_VM_TEMPLATES", "8"))    # templates a node keeps (least recently used go)


@dataclass
class Template:
    key: str
    dir: Path
    ram: int                  # the sealed memfd
    size: int                 # its bytes (the VM's memory)
    used: float = field(default_factory=time.monotonic)

    @property
    def state(self) -> Path:
        return self.dir / "state"

    @property
    def disk(self) -> Path:
        return self.dir / "disk.img"


def key_of(*parts: object, layers: list[str]) -> str:
    """A template's key: what it was booted with, and each layer file's identity (a layer rewritten in place
    is a new key, so its template is rebuilt)."""
    h = hashlib.sha256(repr(parts).encode())
    for path in layers:
        st = os.stat(path)
        h.update(f"{path}\0{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}\0".encode())
    return h.hexdigest()[:24]


def new_ram(size: int) -> int:
    fd = os.memfd_create("dsec-template", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    return fd


def seal(fd: int) -> None:
    """No write, resize or new seal from now on (the template VM that wrote it must be gone)."""
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)


def copy_sparse(src: Path, dst: Path) -> None:
    """Copy a sparse file's data extents only (the disk of a template is mostly holes)."""
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        size = os.fstat(fi.fileno()).st_size
        fo.truncate(size)
        off = 0
        while off < size:
            try:
                start = os.lseek(fi.fileno(), off, os.SEEK_DATA)
            except OSError:
                break                   # ENXIO: holes to the end
            end = os.lseek(fi.fileno(), start, os.SEEK_HOLE)
            pos = start
            while pos < end:
                n = os.copy_file_range(fi.fileno(), fo.fileno(), end - pos, pos, pos)
                if n <= 0:
                    raise OSError(f"copy_file_range stopped at {pos} of {src}")
                pos += n
            off = end


class Templates:
    """The node's templates by key: one build per key at a time, the least recently used dropped past KEEP."""

    def __init__(self, root: Path, keep: int = KEEP) -> None:
        self.root = root
        self.keep = max(1, keep)
        self._ready: dict[str, Template] = {}
        self._building: dict[str, asyncio.Future] = {}
        self.built = 0            # templates built since start (each is one cold boot)

    async def get(self, key: str, build: Callable[[Path], Awaitable[tuple[int, int]]]) -> Template:
        """The template of key, built by build(dir) -> (memfd, size) if the node has none yet."""
        t = self._ready.get(key)
        if t is not None:
            t.used = time.monotonic()
            return t
        pending = self._building.get(key)
        if pending is None:
            pending = self._building[key] = asyncio.ensure_future(self._build(key, build))
            pending.add_done_callback(lambda f: f.cancelled() or f.exception())   # a failure is every waiter's
        return await asyncio.shield(pending)

    async def _build(self, key: str, build: Callable[[Path], Awaitable[tuple[int, int]]]) -> Template:
        path = self.root / key
        try:
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(mode=0o700, parents=True)
            ram, size = await build(path)
            t = self._ready[key] = Template(key, path, ram, size)
            self.built += 1
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        finally:
            self._building.pop(key, None)
        for old in sorted(self._ready.values(), key=lambda x: x.used)[:max(0, len(self._ready) - self.keep)]:
            self.drop(old.key)
        return t

    def drop(self, key: str) -> None:
        """Forget a template (VMs restored from it keep their mapping of its RAM)."""
        t = self._ready.pop(key, None)
        if t is not None:
            with contextlib.suppress(OSError):
                os.close(t.ram)
            shutil.rmtree(t.dir, ignore_errors=True)

    async def clear(self) -> None:
        for f in list(self._building.values()):
            f.cancel()
            with contextlib.suppress(BaseException):
                await f
        for key in list(self._ready):
            self.drop(key)
        shutil.rmtree(self.root, ignore_errors=True)

    def held(self) -> list[str]:
        return sorted(self._ready)
