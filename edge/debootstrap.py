"""`dsec image build NAME --debootstrap SUITE --packages a,b`: a real Debian root made by Debian's
debootstrap (minbase variant plus the packages), cached by what made it (suite, packages, mirror,
architecture), so building the same base again costs no download and gives the same layer.

The mirror is the one this machine's apt uses for Debian (deb822 `.sources` files or sources.list),
unless --mirror names another. The cache lives in $DSEC_CACHE/debootstrap (default /var/cache/dsec).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

from bus.errors import InvalidRequest
from edge.erofs import LayerBuildError

APT_SOURCES = Path("/etc/apt")
TIMEOUT = 3600.0     # seconds a debootstrap may take (a slow mirror, many packages)
_SUITE = re.compile(r"^[a-z][a-z0-9-]{1,31}$")
_PACKAGE = re.compile(r"^[a-z0-9][a-z0-9+.-]{0,99}$")
_VARIANT = "minbase"


def cache_dir() -> Path:
    """Where finished roots are kept."""
    return Path(os.environ.get("DSEC_CACHE", "/var/cache/dsec")) / "debootstrap"


def parse_packages(text: str) -> list[str]:
    """'python3,git' -> sorted, de-duplicated names; InvalidRequest for anything not a package name."""
    names = sorted({p.strip() for p in text.split(",") if p.strip()})
    bad = [p for p in names if not _PACKAGE.match(p)]
    if bad:
        raise InvalidRequest(f"--packages: not Debian package names: {', '.join(bad)}")
    return names


def apt_mirror(root: Path = APT_SOURCES) -> str:
    """The Debian archive this machine's apt uses (the first `deb` source whose path ends in /debian)."""
    uris: list[str] = []
    for f in sorted((root / "sources.list.d").glob("*.sources")):
        for stanza in f.read_text(errors="replace").split("\n\n"):
            fields = dict(line.split(":", 1) for line in stanza.splitlines()
                          if ":" in line and not line.startswith(("#", " ")))
            if "deb" in fields.get("Types", "").split() and fields.get("Enabled", "yes").strip() != "no":
                uris += fields.get("URIs", "").split()
    lists = [root / "sources.list", *sorted((root / "sources.list.d").glob("*.list"))]
    for f in lists:
        if f.is_file():
            for line in f.read_text(errors="replace").splitlines():
                words = re.sub(r"\[[^]]*\]", "", line).split()   # drop [options]
                if len(words) >= 3 and words[0] == "deb":
                    uris.append(words[1])
    for uri in uris:
        if uri.rstrip("/").endswith("/debian"):
            return uri.rstrip("/")
    raise InvalidRequest("no Debian mirror found in this machine's apt sources: give --mirror URL")


def _arch() -> str:
    try:
        return subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        machine = os.uname().machine
        return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def root_for(suite: str, packages: list[str], mirror: str, log=print) -> Path:
    """A finished root for these settings: from the cache, or made now by debootstrap."""
    if not _SUITE.match(suite):
        raise InvalidRequest(f"--debootstrap: {suite!r} is not a Debian suite name (e.g. bookworm)")
    if not re.match(r"^(https?|file)://\S+$", mirror):
        raise InvalidRequest(f"--mirror: {mirror!r} is not an http(s) or file URL")
    tool = shutil.which("debootstrap")
    if tool is None:
        raise InvalidRequest("debootstrap is not installed (apt-get install debootstrap)")
    arch = _arch()
    key = hashlib.sha256(json.dumps([suite, packages, mirror, _VARIANT, arch]).encode()).hexdigest()[:16]
    done = cache_dir() / f"{suite}-{arch}-{key}"
    if (done / "root").is_dir():
        log(f"debootstrap {suite} ({', '.join(packages) or 'no extra packages'}): cached in {done}")
        return done / "root"
    work = cache_dir() / f".{done.name}.{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        argv = [tool, f"--variant={_VARIANT}", f"--arch={arch}"]
        if packages:
            argv.append(f"--include={','.join(packages)}")
        argv += [suite, str(work / "root"), mirror]
        log(f"debootstrap {suite} ({', '.join(packages) or 'no extra packages'}) from {mirror}: this takes minutes")
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)   # its own group: a timeout kills dpkg & co too
        try:
            out, _ = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            raise LayerBuildError(f"debootstrap did not finish within {TIMEOUT:.0f} s") from None
        finally:   # however it ended, nothing it started goes on writing
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc.returncode != 0:
            tail = "\n".join(out.strip().splitlines()[-5:])
            raise LayerBuildError(f"debootstrap failed (exit {proc.returncode}): {tail}")
        _slim(work / "root")
        try:
            os.rename(work, done)
        except OSError:   # another build finished the same root first: use that one
            if not (done / "root").is_dir():
                raise
        return done / "root"
    finally:
        if _unmount_under(work):   # /proc, /sys... a killed debootstrap left mounted in its chroot
            shutil.rmtree(work, ignore_errors=True)


def _mounts_under(path: Path) -> list[str]:
    prefix = f"{path.resolve()}/"
    with open("/proc/self/mountinfo") as f:
        return [p for p in (line.split()[4] for line in f) if p.startswith(prefix)]


def _unmount_under(path: Path) -> bool:
    """Detach every mount below path; whether none is left (else its files must not be removed)."""
    for point in sorted(_mounts_under(path), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True)
    return not _mounts_under(path)


def _slim(root: Path) -> None:
    """Drop what a layer need not carry: downloaded .debs and apt's package lists."""
    for pattern in ("var/cache/apt/archives/*.deb", "var/lib/apt/lists/*_Packages", "var/lib/apt/lists/*_InRelease"):
        for f in root.glob(pattern):
            f.unlink(missing_ok=True)
