"""Making EROFS layer files: pack a directory, and lay out a busybox root from Debian's busybox-static."""
from __future__ import annotations

import hashlib
import os
import shutil
import struct
import subprocess
from pathlib import Path

BUSYBOX_CANDIDATES = ("/bin/busybox", "/usr/bin/busybox")
ROOT_DIRS = ("bin", "dev", "etc", "proc", "sys", "tmp", "root", "home", "usr/bin", "var/tmp")


class LayerBuildError(Exception):
    """A layer could not be built; the message is one clear line."""


FIXED_UUID = "00000000-0000-0000-0000-000000000000"
# A layer a VM maps through virtio-pmem with DAX (fullvm/osimage.py): the guest's pmem driver maps only a
# region of whole 2 MiB subsections ("misaligned, unable to map" otherwise), and EROFS reads through DAX
# only files stored whole in blocks (FLAT_PLAIN), not those whose tail is inlined beside the inode.
DAX_ALIGN = 2 << 20


# The superblock's build time, fixed so that the same tree packs to the same bytes. mkfs.erofs (1.5) keeps each
# file's mtime below it (SOURCE_DATE_EPOCH clamps, in extended inodes): far in the future, it keeps them all.
BUILD_TIME = 4102444800   # 2100-01-01
PACKING = 2   # how pack_dir packs (2: mtimes kept); in the keys of packed layers cached outside a state dir
MAX_NAME = 254   # bytes of one name this mkfs.erofs (1.5) packs: 255 fails "No such file or directory", naming none


def pack_dir(src: Path, dst: Path, *, dax: bool = False, sparse: bool = False) -> str:
    """Pack directory src into the EROFS file dst (owners, modes and mtimes kept); return its sha256 digest.
    Reproducible: a fixed build time and filesystem UUID, so the same tree always gives the same bytes,
    hence the same digest (a layer is stored once; an unchanged rebuild makes no new version). Mtimes are
    kept because programs read them: Python trusts a .pyc only while its source has the mtime it
    recorded (with every mtime 0, each process compiled every module it imported again, in memory), and
    make compares them.
    dax: for a guest to map (see DAX_ALIGN): no inline tails, the file padded with zeros to whole 2 MiB
    (EROFS reads nothing past its own blocks); ~10% larger for a Debian root.
    sparse: files stored in 4 KiB chunks, of which those all zero (holes among them) are stored as none: a
    sparse file costs its data, not its size. mkfs.erofs (1.5) then reads every byte of every file (7 s per
    GiB here, holes too, against about 1 s written whole), so only for a tree with holes."""
    if not src.is_dir():
        raise LayerBuildError(f"not a directory: {src}")
    if shutil.which("mkfs.erofs") is None:
        raise LayerBuildError("mkfs.erofs not found: install erofs-utils (make setup does)")
    tmp = dst.with_suffix(".tmp")
    proc = subprocess.run(["mkfs.erofs", "--quiet", f"-U{FIXED_UUID}",
                           *(["-E", "noinline_data"] if dax else []), *(["--chunksize=4096"] if sparse and not dax else []),
                           str(tmp), str(src)],
                          capture_output=True, text=True, env={**os.environ, "SOURCE_DATE_EPOCH": str(BUILD_TIME)})
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise LayerBuildError(f"mkfs.erofs failed: {proc.stderr.strip().splitlines()[-1:]}")
    if dax:
        os.truncate(tmp, -(-tmp.stat().st_size // DAX_ALIGN) * DAX_ALIGN)
    digest = file_digest(tmp)
    os.replace(tmp, dst)
    return digest


def file_digest(path: Path) -> str:
    """sha256 of a file as 'sha256:<hex>'."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return "sha256:" + h.hexdigest()


BASH_STATIC = "/bin/bash-static"


def find_trusted_shell() -> str:
    """The static shell string commands run with (chronus/shell.py): Debian's bash-static; without it (not
    set up again since it was added) busybox, whose sh prefers its own applets to the image's programs."""
    if os.path.exists(BASH_STATIC) and is_static_elf(BASH_STATIC):
        return BASH_STATIC
    import logging
    logging.getLogger(__name__).warning("no %s (make setup installs bash-static): string commands run under "
                                        "busybox's sh, which runs its applets instead of the image's programs",
                                        BASH_STATIC)
    return find_busybox()


def find_busybox() -> str:
    """Path of a static busybox on this host (a dynamic one would find no libc inside the image)."""
    for cand in BUSYBOX_CANDIDATES:
        if os.path.exists(cand):
            if not is_static_elf(cand):
                raise LayerBuildError(f"{cand} is dynamically linked: install busybox-static (make setup does)")
            return cand
    raise LayerBuildError("busybox not found: install busybox-static (make setup does)")


def is_static_elf(path: str) -> bool:
    """Whether an ELF64 executable has no program interpreter (PT_INTERP), i.e. is statically linked."""
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2:
            return False
        phoff, = struct.unpack_from("<Q", head, 32)
        phentsize, phnum = struct.unpack_from("<HH", head, 54)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    return all(struct.unpack_from("<I", table, i * phentsize)[0] != 3 for i in range(phnum))


def busybox_rootfs(root: Path) -> None:
    """Lay out a minimal root in `root`: busybox with one symlink per applet, /tmp 1777, /etc files."""
    busybox = find_busybox()
    for d in ROOT_DIRS:
        (root / d).mkdir(parents=True, exist_ok=True)
    os.chmod(root / "tmp", 0o1777)
    os.chmod(root / "var/tmp", 0o1777)
    shutil.copy2(busybox, root / "bin/busybox")
    applets = subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True).stdout.split()
    for name in applets:
        link = root / "bin" / name
        if name != "busybox" and not link.exists():
            link.symlink_to("busybox")
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n")
    (root / "etc/group").write_text("root:x:0:\nnogroup:x:65534:\n")
    (root / "etc/hosts").write_text("127.0.0.1 localhost\n::1 localhost\n")
    fix_mtimes(root)


def mtime_ns(mtime: float) -> int:
    """An archive member's mtime in ns, for os.utime (0 for one out of range: a layer's times are not worth
    refusing it for)."""
    try:
        return max(0, min(int(mtime * 1e9), (1 << 63) - 1))
    except (OverflowError, ValueError):
        return 0


def set_dir_mtimes(root: Path, times: dict[str, int]) -> None:
    """After a tree was unpacked (each entry added to a directory set its mtime to now): every directory's
    mtime as its archive gave it (times: path relative to root, '' for root -> ns), 0 for one it did not name
    (the root, a parent made on the way), so the same archive packs to the same layer. Symlinks are not
    followed: only the tree's own directories are touched (a child's utime changes no mtime of its parent, so
    the order does not matter)."""
    from edge.backends.treeops import walk
    for path, _dirs, _files in walk(root):
        rel = os.path.relpath(path, root)
        at = times.get("" if rel == "." else rel, 0)
        os.utime(path, ns=(at, at), follow_symlinks=False)


def fix_mtimes(root: Path, at: int = 0) -> None:
    """Give every entry of a tree made here (not copied from elsewhere) the same mtime, so that the layer
    packed from it has the same digest each time it is made."""
    for path in [root, *root.rglob("*")]:
        os.utime(path, (at, at), follow_symlinks=False)
