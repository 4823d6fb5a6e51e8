"""Packing a sandbox's writable layer as an EROFS layer: its apparent size (what packing writes), and the
pack itself through an idmapped view (owners relative to the sandbox)."""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from edge.backends import idmap, kernel
from edge.backends.treeops import walk
from edge.erofs import MAX_NAME


HOLES = 64 << 20   # bytes of holes (sparse files), and a quarter of the tree, past which a tree is packed with
                   # its holes kept (pack_dir: the pack then reads every byte, 7 s per GiB against 1 s written)


def keeps_holes(size: int, holes: int) -> bool:
    """Whether a tree of `size` apparent bytes, `holes` of them holes, is packed with its holes kept."""
    return holes >= HOLES and 4 * holes >= size


def apparent_size(root: Path) -> tuple[int, int]:
    """(bytes the files under root claim: st_size of every regular file, links counted once each, plus 4 KiB
    per other inode: what packing them as a layer reads; of those, the bytes of holes in sparse files).
    SnapshotTooLarge for a tree no layer can hold: a name longer than MAX_NAME, or a path too long for the
    packer's (path-based) walk, named as the sandbox sees them."""
    from edge.backends.base import SnapshotTooLarge
    total, holes, seen = 0, 0, set()
    try:
        for dirpath, dirnames, filenames in walk(root):
            total += 4096 * (len(dirnames) + 1)
            for name in dirnames + filenames:
                if len(os.fsencode(name)) > MAX_NAME:
                    raise SnapshotTooLarge(f"{inside(root, os.path.join(dirpath, name))[:300]}: a name of "
                                           f"{len(os.fsencode(name))} bytes (a layer holds names of up to {MAX_NAME})")
            for name in filenames:
                st = os.lstat(os.path.join(dirpath, name))
                if st.st_nlink > 1:
                    if st.st_ino in seen:
                        continue
                    seen.add(st.st_ino)
                total += st.st_size if stat.S_ISREG(st.st_mode) else 4096
                if stat.S_ISREG(st.st_mode):
                    holes += max(0, st.st_size - st.st_blocks * 512)
    except OSError as exc:
        if exc.errno != errno.ENAMETOOLONG:
            raise
        raise SnapshotTooLarge(f"a path too deep to pack: {inside(root, exc.filename or '')[:120]}... (about "
                               f"{len(os.fsencode(exc.filename or '')) - len(os.fsencode(str(root)))} bytes; "
                               f"the node packs paths of up to {4095 - len(os.fsencode(str(root)))})") from None
    return total, holes


def inside(root: Path, path: str) -> str:
    """path (under root, the sandbox's upper) as the sandbox names it: never the node's own paths."""
    rel = os.path.relpath(path, root) if path else ""
    return "/" + (rel if rel != "." else "")


def pack_relative(upper: Path, dst: Path, ids: idmap.IdRange, view: Path, sparse: bool = False) -> str:
    """mkfs.erofs of upper as the sandbox sees its owners (host base+n packed as n), through a read-only
    idmapped view of it mounted at `view` for the pack (mkfs.erofs resolves its source path, so a detached
    view read through /proc/self/fd would be resolved away). The view is the node's (state_dir/packing/<key>:
    not in the upper's capped subvolume, where a full sandbox left no room for it, nor in any directory a
    recursive clean-up removes, which would go through the mount); a start unmounts and removes what a crash
    left there (lifecycle._reconcile)."""
    from edge.erofs import pack_dir
    view.mkdir(parents=True, exist_ok=True)
    userns = idmap.relative_userns(ids)
    try:
        kernel.idmap_over(str(upper), userns, at=str(view), readonly=True)
    finally:
        os.close(userns)
    try:
        return pack_dir(view, dst, sparse=sparse)
    finally:
        kernel.umount2(str(view), kernel.MNT_DETACH)
        view.rmdir()
