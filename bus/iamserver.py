"""The server's side of the identities (bus/iam.py): the configuration a server runs with, the servers of
a state dir, reloads (SIGHUP, waiting for the server to say it reloaded) and the sweep of expired
credentials out of the configuration."""
from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import psutil

from bus.iam import Iam, IamError, state_lock

log = logging.getLogger(__name__)


def server_conf(iam: Iam, base: Path) -> Path:
    """`<state>/iam/server.conf`: the repo's nats.conf with the accounts included (nats-server includes
    only relative paths, so the base is copied beside it)."""
    iam.write_conf()
    path = iam.root / "iam" / "server.conf"
    text = base.read_text() if base.exists() else ""
    path.write_text(text + f"\n# Identities (written by dsec: `dsec iam`, see bus/iam.py)\n"
                           f"include \"{iam.conf_path.name}\"\n")
    return path


def _servers_file(iam: Iam) -> Path:
    return iam.root / "iam" / "servers.json"


def register_server(iam: Iam, pid: int, log: Path) -> None:
    """Remember a running server of these identities (pid, log) so `dsec iam` can reload it."""
    path = _servers_file(iam)
    known = [s for s in _servers(iam) if psutil.pid_exists(s["pid"]) and s["pid"] != pid]
    known.append({"pid": pid, "log": str(log)})
    path.write_text(json.dumps(known))


def _servers(iam: Iam) -> list[dict]:
    try:
        return list(json.loads(_servers_file(iam).read_text()))
    except (OSError, ValueError):
        return []


RELOADED = "Reloaded server configuration"


def reload(iam: Iam, timeout: float = 10.0) -> int:
    """Make every live server of these identities re-read them (SIGHUP); wait until each logs that it
    did. Returns how many were reloaded; IamError when one refuses the configuration.

    Each server is reloaded twice: nats-server (2.15.1 here) leaves the service imports of an account that
    a reload adds unwired until the next reload (its stream imports work at once); a second reload of
    the same configuration wires them (tests/test_iam.py adds a tenant at run time and uses it)."""
    done = 0
    for s in _servers(iam):
        if not psutil.pid_exists(s["pid"]):
            continue
        _reload_one(s, timeout)
        _reload_one(s, timeout)
        done += 1
    return done


def _reload_one(s: dict, timeout: float) -> None:
    """SIGHUP one server; wait until its log says it reloaded (IamError if it refused or said nothing)."""
    log = Path(s["log"])
    mark = log.stat().st_size if log.exists() else 0
    os.kill(s["pid"], signal.SIGHUP)
    deadline = time.monotonic() + timeout
    while True:
        with open(log, "rb") as f:   # only what the server wrote since the signal
            f.seek(mark)
            text = f.read().decode(errors="replace")
        if RELOADED in text:
            break
        failed = [line for line in text.splitlines() if "Failed to reload" in line or "[FTL]" in line]
        if failed:
            raise IamError(f"the NATS server refused the new identities: {failed[-1]}")
        if time.monotonic() > deadline:
            raise IamError(f"the NATS server (pid {s['pid']}) did not reload within {timeout:.0f}s (see {log})")
        time.sleep(0.02)


def _key_of(iam: Iam, principal: str) -> str:
    if principal.startswith("tenant:"):
        t = iam.tenants.get(principal[7:])
        return next(iter(t.users.values()), "") if t else ""
    return iam.platform.get(principal, "")


def sweep(root: Path) -> int:
    """Take the credentials that expired out of the servers' configuration and reload them: the server
    closes their connections and refuses their next ones. Returns how many were taken out. `dsec up`'s
    server runs it every second; a server of our own runs `dsec iam sweep` (cron, a systemd timer)."""
    with state_lock(root):
        iam = Iam.load(root)
        try:
            conf = iam.conf_path.read_text()
        except OSError:
            return 0
        now = time.time()
        stale = [p for p, at in iam.expires.items() if at <= now and (key := _key_of(iam, p)) and key in conf]
        if not stale:
            return 0
        iam.write_conf()
        reload(iam)
    log.info("credentials expired: %s", ", ".join(stale))
    return len(stale)


class ExpirySweeper:
    """A thread running sweep() every `every` seconds beside a server (bus/server.py) until stopped."""

    def __init__(self, root: Path, every: float = 1.0) -> None:
        self.root, self.every = Path(root), every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dsec-iam-sweep", daemon=True)

    def start(self) -> "ExpirySweeper":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                sweep(self.root)
            except Exception as exc:   # (a server gone meanwhile, a refused reload): said, tried again
                log.warning("expiry sweep of %s: %s", self.root, exc)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=15)
