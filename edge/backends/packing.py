"""Packing a sandbox's writable layer as an EROFS layer: its apparent size (what packing writes), and the
pack itself through an idmapped view (owners relative to the sandbox)."""
from __future__ import annotations

import os
import stat
from pathlib import Path

from edge.backends import idmap, kernel
from edge.backends.treeops import walk


def apparent_size(root: Path) -> int:
    """Bytes the files under root claim (st_size of every regular file, links counted once each), plus
    4 KiB per other inode: what packing them as a layer writes."""
    total, seen = 0, set()
    for dirpath, dirnames, filenames in walk(root):
        total += 4096 * (len(dirnames) + 1)
        for name in filenames:
            st = os.lstat(os.path.join(dirpath, name))
            if st.st_nlink > 1:
                if st.st_ino in seen:
                    continue
                seen.add(st.st_ino)
            total += st.st_size if stat.S_ISREG(st.st_mode) else 4096
    return total


def pack_relative(upper: Path, dst: Path, ids: idmap.IdRange) -> str:
    """mkfs.erofs of upper as the sandbox sees its owners (host base+n packed as n), through an idmapped
    view mounted beside it for the pack (mkfs.erofs resolves its source path, so a detached view read
    through /proc/self/fd would be resolved away)."""
    from edge.erofs import pack_dir
    view = upper.parent / "packing"
    view.mkdir(exist_ok=True)
    userns = idmap.relative_userns(ids)
    try:
        kernel.idmap_over(str(upper), userns, at=str(view))
    finally:
        os.close(userns)
    try:
        return pack_dir(view, dst)
    finally:
        kernel.umount2(str(view), kernel.MNT_DETACH)
        view.rmdir()
