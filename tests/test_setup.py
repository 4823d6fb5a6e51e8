"""The README's setup step (`make setup`'s `system` recipe) on a machine that lacks every tool.

apt-get and the service tools are stand-ins here (a small PATH of our own); the recipe's shell, make and
pkill are real, and so are the daemons it must stop: processes named like Debian's services, run by their
packages' users, beside one of the same name run by root (an edge's own mirror), which it must not touch."""
from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STUBS = {"apt-get": 'echo "apt-get $*" >> "$SETUP_LOG"', "systemctl": "exit 0", "update-rc.d": "exit 0",
         "umount": "exit 0", "pkg-config": "exit 1"}
SERVICES = {"apt-cacher-ng": "apt-cacher-ng", "docker-registry": "docker-registry"}   # daemon name -> its user


def _daemon(exe: Path, user: str | None) -> subprocess.Popen:
    argv = [str(exe), "300"]
    if user is not None:
        argv = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *argv]
    return subprocess.Popen(argv)


def test_the_system_recipe_installs_and_stops_debians_services_without_killing_itself():
    bindir = Path(tempfile.mkdtemp(prefix="dsec-setup-"))
    procs: list[subprocess.Popen] = []
    try:
        os.chmod(bindir, 0o755)
        log = bindir / "log"
        for name, body in STUBS.items():
            (bindir / name).write_text(f"#!/bin/sh\n{body}\n")
            (bindir / name).chmod(0o755)
        (bindir / "pkill").symlink_to(shutil.which("pkill"))
        theirs, ours = [], []
        for name, user in SERVICES.items():
            pwd.getpwnam(user)   # made by the package, which the suite's own setup installed
            exe = bindir / name
            shutil.copy("/bin/sleep", exe)
            exe.chmod(0o755)
            theirs.append(_daemon(exe, user))
            ours.append(_daemon(exe, None))
        procs = theirs + ours
        env = {"PATH": str(bindir), "SETUP_LOG": str(log), "HOME": "/root"}
        p = subprocess.run(["/usr/bin/make", "-s", "-C", str(REPO), "system", f"PYTHON={sys.executable}"],
                           env=env, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, (p.returncode, p.stdout, p.stderr)
        assert "setup: installing Debian packages (missing: mkfs.erofs" in p.stdout, p.stdout
        calls = log.read_text().splitlines()
        assert calls[0] == "apt-get update -qq" and calls[1].startswith("apt-get install -y -qq erofs-utils"), calls
        for d in theirs:
            assert d.wait(timeout=10) != 0, d.args   # stopped: Debian's service must not hold its port
        for d in ours:
            assert d.poll() is None, d.args          # an edge's own mirror (root's) is not Debian's service
    finally:
        for d in procs:
            d.kill()
            d.wait()
        shutil.rmtree(bindir, ignore_errors=True)
