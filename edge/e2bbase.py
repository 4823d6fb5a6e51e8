"""`dsec image build base --e2b-base`: the image E2B's default template is, on DSec. A debootstrapped Debian
(bookworm) with bash, python3, pip, venv, curl, git, ca-certificates and sudo, and E2B's user: `user` (uid and
gid 1000, in group sudo), home /home/user, bash its shell, passwordless sudo. Commands run as `user` in /home/user
by default (the image's config), as E2B's do; `user="root"` runs as the sandbox's root.

sudo works because commands do not run with no_new_privs (see dsec-enter.c): sudo is setuid to the sandbox's
root, a uid of the sandbox's own range, so what it grants is root inside the sandbox only, within the
capability bounding set every command has.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from bus.records import ImageConfig

SUITE = "bookworm"
PACKAGES = ["bash", "ca-certificates", "curl", "git", "python3", "python3-pip", "python3-venv", "sudo"]
USER, UID, HOME = "user", 1000, "/home/user"
CONFIG = ImageConfig(env={"LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}, cwd=HOME, user=USER)
SUDOERS = f"{USER} ALL=(ALL:ALL) NOPASSWD: ALL\n"


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _write(path: Path, lines: list[str], mode: int) -> None:
    text = "".join(f"{line}\n" for line in lines)
    with contextlib.suppress(OSError):
        if path.read_text() == text and path.stat().st_mode & 0o7777 == mode:
            return   # unchanged: its mtime (and its dir's) too, so the root packs to the same bytes again
    tmp = path.with_name(path.name + ".dsec")
    tmp.write_text(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def add_user(root: Path) -> None:
    """Make E2B's `user` in a Debian root (idempotent): passwd, shadow (no password: sudo asks none), its
    group, membership of sudo, /home/user from /etc/skel owned by it, and its sudoers rule."""
    etc = root / "etc"
    passwd = [ln for ln in _lines(etc / "passwd") if not ln.startswith(f"{USER}:")]
    _write(etc / "passwd", passwd + [f"{USER}:x:{UID}:{UID}::{HOME}:/bin/bash"], 0o644)
    shadow = [ln for ln in _lines(etc / "shadow") if not ln.startswith(f"{USER}:")]
    _write(etc / "shadow", shadow + [f"{USER}:*:19000:0:99999:7:::"], 0o640)
    groups = []
    for line in _lines(etc / "group"):
        name, pw, gid, members = (line.split(":") + ["", "", ""])[:4]
        if name == USER:
            continue
        if name == "sudo" and USER not in members.split(","):
            members = ",".join([m for m in members.split(",") if m] + [USER])
        groups.append(":".join([name, pw, gid, members]))
    _write(etc / "group", groups + [f"{USER}:x:{UID}:"], 0o644)
    if (etc / "gshadow").exists():
        gshadow = [ln for ln in _lines(etc / "gshadow") if not ln.startswith(f"{USER}:")]
        _write(etc / "gshadow", gshadow + [f"{USER}:!::"], 0o640)
    (etc / "sudoers.d").mkdir(exist_ok=True)
    _write(etc / "sudoers.d" / USER, [SUDOERS.strip()], 0o440)
    home = root / HOME.lstrip("/")
    if not home.exists():
        shutil.copytree(etc / "skel", home, symlinks=True) if (etc / "skel").is_dir() else home.mkdir(parents=True)
    for path in [home, *home.rglob("*")]:
        os.lchown(path, UID, UID)
    os.chmod(home, 0o750)


def root(log=print) -> Path:
    """The base's root, debootstrapped once and cached (edge/debootstrap.py), with E2B's user in it."""
    from edge import debootstrap
    made = debootstrap.root_for(SUITE, sorted(PACKAGES), debootstrap.apt_mirror(), log)
    add_user(made)   # (idempotent: a root it changed packs to the same bytes again)
    return made


if __name__ == "__main__":   # `make setup`: the root cached ahead (the build then only packs it)
    print(f"E2B base root: {root()}")


async def ensure_published(bus, log=print, name: str = "base") -> bool:
    """Publish the base image as `name` unless the store has an image of that name; True when it did. The root
    and its packed layer are cached outside any state dir ($DSEC_CACHE), so a fresh `dsec up` only uploads."""
    import asyncio
    from bus.errors import ImageNotFound
    from bus.images import ImageRegistry
    from edge.erofs import PACKING, pack_dir
    registry = ImageRegistry(bus)
    try:
        await registry.resolve(name, cache_for=0)
        return False
    except ImageNotFound:
        pass
    made = await asyncio.to_thread(root, log)
    layer = made.parent / f"e2b-base.p{PACKING}.erofs"
    digest_file = layer.with_suffix(".digest")
    if not (layer.exists() and digest_file.exists()):
        tmp = layer.with_name(f".e2b-base.{os.getpid()}.erofs")
        digest = await asyncio.to_thread(pack_dir, made, tmp)
        os.replace(tmp, layer)
        digest_file.write_text(digest)
    rec, _ = await registry.publish(name, layer, digest_file.read_text().strip(), "base", CONFIG)
    log(f"E2B base image published as {rec.name}@{rec.version} ({rec.size >> 20} MiB)")
    return True
