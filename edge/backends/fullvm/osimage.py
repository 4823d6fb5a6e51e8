"""The operating system of a full VM: Debian bookworm (debootstrap's minbase with systemd), its units
trimmed for a VM with no console login and no network, packed into one EROFS file in the VM cache
($DSEC_VM_CACHE, outside any state dir). It is the lowest layer of every full VM; the image's layers go
over it, so any image boots as a whole Debian with its own files on top.

`make setup` builds it (`python -m edge.backends.fullvm`): a debootstrap from the Debian mirror
this machine's apt uses (cached by edge/debootstrap.py), a few minutes once. The fullvm backend stays off
where it is missing.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from edge import debootstrap
from edge.backends.microvm.guest import cache_dir
from edge.erofs import DAX_ALIGN, PACKING, LayerBuildError, pack_dir

SUITE = "bookworm"
PACKAGES = ["systemd", "systemd-sysv"]
# What a VM without a console login, a network or a D-Bus has no use for (masked: linked to /dev/null),
# so its boot ends `running` and its idle vCPUs stay idle.
MASKED = ("getty@.service", "serial-getty@.service", "console-getty.service", "systemd-logind.service",
          "apt-daily.timer", "apt-daily-upgrade.timer", "dpkg-db-backup.timer", "e2scrub_all.timer",
          "e2scrub_reap.service", "fstrim.timer", "systemd-networkd-wait-online.service",
          "getty-static.service",
          # Debian's packages made their users at install; an image's own /etc/passwd over Debian's (busybox's
          # has two users) made sysusers fail on Debian's /etc/gshadow, and the system `degraded`
          "systemd-sysusers.service")
TWEAKS = 2          # bump when what tweak() does to the root changes (MASKED is in the stamp already)


def path() -> Path:
    return cache_dir() / "fullvm-os.erofs"


def dax_ready(layer: str) -> bool:
    """Whether layer is an OS layer (this node's, or one a memory snapshot holds open: /proc/self/fd/N)
    built for a guest to map (pack_dir's dax). One built before is attached as a disk, its pages read into
    each guest's own page cache (make setup builds it anew)."""
    try:
        name = os.readlink(layer) if layer.startswith("/proc/") else layer
        return Path(name).name.startswith(path().name) and os.stat(layer).st_size % DAX_ALIGN == 0
    except OSError:
        return False


def missing() -> str:
    """'' when the OS layer is built, else why not (a cheap check)."""
    return "" if path().is_file() else f"no full-VM OS layer at {path()} (make setup builds it)"


def tweak(root: Path) -> None:
    """What a VM's root needs beyond debootstrap's: masked units, no login prompt, an empty machine-id (a
    VM makes its own at boot; a restored one gets a fresh one from its agent)."""
    units = root / "etc/systemd/system"
    for unit in MASKED:
        link = units / unit
        link.unlink(missing_ok=True)
        link.symlink_to("/dev/null")
    shutil.rmtree(units / "getty.target.wants", ignore_errors=True)
    (root / "etc/machine-id").write_text("")
    (root / "var/lib/dbus/machine-id").unlink(missing_ok=True)
    (root / "etc/hostname").unlink(missing_ok=True)     # the kernel's (the sandbox id) is kept


def build(log=print) -> Path:
    """The OS layer, from debootstrap's cached root (made now if missing) with tweak() applied."""
    root = debootstrap.root_for(SUITE, PACKAGES, debootstrap.apt_mirror(), log)
    mark = hashlib.sha256(f"{root}\0{TWEAKS}\0{sorted(MASKED)}\0{PACKING}".encode()).hexdigest()[:16]
    stamp = cache_dir() / "fullvm-os.source"
    if path().is_file() and stamp.is_file() and stamp.read_text().strip() == mark:
        return path()
    cache_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        stage = Path(tmp) / "root"
        cp = subprocess.run(["cp", "-a", str(root), str(stage)], capture_output=True, text=True)
        if cp.returncode != 0:
            raise LayerBuildError(f"copying the Debian root failed: {cp.stderr.strip()[-300:]}")
        tweak(stage)
        out = Path(tmp) / "os.erofs"
        pack_dir(stage, out, dax=True)
        os.chmod(out, 0o444)
        os.replace(out, path())
    stamp.write_text(mark + "\n")
    return path()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m edge.backends.fullvm",
                                 description="Build the full VM's operating system layer (Debian bookworm with "
                                             "systemd, from this machine's Debian mirror) into the VM cache "
                                             "(make setup runs this).")
    ap.parse_args(argv)
    try:
        out = build(lambda msg: print(f"fullvm os: {msg}", file=sys.stderr))
    except (LayerBuildError, OSError, debootstrap.InvalidRequest) as exc:
        print(f"fullvm os: {exc}", file=sys.stderr)
        return 1
    print(f"fullvm os: {out} ({out.stat().st_size >> 20} MiB)")
    return 0

