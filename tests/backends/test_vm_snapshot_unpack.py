"""A microVM's snapshot tar is the guest's to shape (unit: no QEMU): the host unpacks it as untrusted
input, so no member writes outside its tree or through a symlink, no hard link reaches a host file, and no
device but a whiteout is made; what a layer needs (whiteouts, opaque dirs, owners, setuid) is kept."""
from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from edge.backends.microvm.snapshot import UnsafeArchive, unpack


def _tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes]]) -> Path:
    with tarfile.open(path, "w") as tf:
        for info, data in members:
            info.size = len(data) if info.isreg() else 0
            tf.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return path


def _info(name: str, kind=tarfile.REGTYPE, **kw) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    for k, v in kw.items():
        setattr(info, k, v)
    return info


@pytest.fixture
def host(tmp_path):
    """A host file beside the tree that no member may touch, and the empty tree."""
    secret = tmp_path / "secret"
    secret.write_text("host only")
    root = tmp_path / "root"
    root.mkdir()
    return secret, root


def test_what_a_layer_needs_is_kept(tmp_path, host):
    _, root = host
    tar = _tar(tmp_path / "ok.tar", [
        (_info("./", tarfile.DIRTYPE, mode=0o755), b""),
        (_info("./d", tarfile.DIRTYPE, mode=0o711, uid=1000, gid=1001), b""),
        (_info("./d/f", mode=0o4750, uid=1000, gid=1001), b"\x00bin\xff"),
        (_info("./d/h", tarfile.LNKTYPE, linkname="./d/f"), b""),
        (_info("./d/gone", tarfile.CHRTYPE, devmajor=0, devminor=0), b""),
        (_info("./d/l", tarfile.SYMTYPE, linkname="/etc/passwd"), b""),
        (_info("./d/p", tarfile.FIFOTYPE, mode=0o600), b""),
        (_info("./o", tarfile.DIRTYPE, mode=0o755), b""),
    ])
    unpack(tar, root, ["o", "../escape", "d/l"])
    f = os.lstat(root / "d" / "f")
    assert (stat.S_IMODE(f.st_mode), f.st_uid, f.st_gid, f.st_nlink) == (0o4750, 1000, 1001, 2)
    assert (root / "d" / "f").read_bytes() == b"\x00bin\xff"
    gone = os.lstat(root / "d" / "gone")
    assert stat.S_ISCHR(gone.st_mode) and gone.st_rdev == 0
    assert os.readlink(root / "d" / "l") == "/etc/passwd"
    assert stat.S_ISFIFO(os.lstat(root / "d" / "p").st_mode)
    assert os.getxattr(root / "o", "trusted.overlay.opaque") == b"y"
    assert stat.S_IMODE(os.lstat(root / "d").st_mode) == 0o711


@pytest.mark.parametrize("members,why", [
    ([(_info("../secret"), b"pwned")], "leaves the tree"),
    ([(_info("/abs"), b"pwned")], "leaves the tree"),
    ([(_info("./up", tarfile.SYMTYPE, linkname=".."), b""), (_info("./up/secret"), b"pwned")], "under a symlink"),
    ([(_info("./x", tarfile.SYMTYPE, linkname="../secret"), b""), (_info("./y", tarfile.LNKTYPE, linkname="./x"), b"")],
     "hard link"),
    ([(_info("./y", tarfile.LNKTYPE, linkname="../secret"), b"")], "hard link"),
    ([(_info("./sda", tarfile.BLKTYPE, devmajor=8, devminor=0), b"")], "device node"),
    ([(_info("./mem", tarfile.CHRTYPE, devmajor=1, devminor=1), b"")], "device node"),
    ([(_info("./d", tarfile.DIRTYPE), b""), (_info("./d"), b"file over dir")], "both a directory"),
])
def test_a_hostile_tar_is_refused_and_touches_nothing_of_the_host(tmp_path, host, members, why):
    secret, root = host
    with pytest.raises(UnsafeArchive, match=why):
        unpack(_tar(tmp_path / "bad.tar", members), root, [])
    assert secret.read_text() == "host only" and os.lstat(secret).st_nlink == 1


def test_a_later_member_replaces_a_symlink_instead_of_writing_through_it(tmp_path, host):
    secret, root = host
    unpack(_tar(tmp_path / "dup.tar", [(_info("./f", tarfile.SYMTYPE, linkname=str(secret)), b""),
                                       (_info("./f"), b"mine")]), root, [])
    assert secret.read_text() == "host only"
    assert not (root / "f").is_symlink() and (root / "f").read_bytes() == b"mine"


def test_directories_keep_the_guests_mtimes(tmp_path, host):
    """Each member extracted after its directory set that one's mtime to now: the tree's directories get
    the guest's times back once everything is in (the root, which no member names, 0)."""
    _, root = host
    tar = _tar(tmp_path / "times.tar", [
        (_info("./d", tarfile.DIRTYPE, mode=0o755, mtime=1_600_000_000), b""),
        (_info("./d/e", tarfile.DIRTYPE, mode=0o755, mtime=1_500_000_000), b""),
        (_info("./d/e/f", mode=0o644, mtime=1_400_000_000), b"x"),
        (_info("./d/g", mode=0o644, mtime=1_300_000_000), b"y"),
    ])
    unpack(tar, root, [])
    assert [os.lstat(p).st_mtime for p in (root / "d", root / "d/e", root / "d/e/f", root / "d/g", root)] == \
        [1_600_000_000, 1_500_000_000, 1_400_000_000, 1_300_000_000, 0]
