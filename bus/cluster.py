"""A local JetStream cluster: N nats-servers on loopback, each rendered from the repo's nats-cluster.conf.

For tests, benchmarks and chaos runs (kill / restart one server); real deployments render the same
template on each machine (see the comments at the top of nats-cluster.conf).
"""
from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

from bus.errors import BusUnavailable
from bus.server import NatsServer, check_port_free, free_port

CLUSTER_CONF = Path(__file__).resolve().parent.parent / "nats-cluster.conf"
PROBE_STREAM = "DSEC_CLUSTER_PROBE"   # created and deleted by the readiness check

_PLACEHOLDER = re.compile(r"\$\{([A-Z_][A-Z0-9_]*)\}")


def render(template: str, values: dict[str, str]) -> str:
    """Fill the ${NAME} placeholders of the non-comment lines; ValueError naming any left unfilled."""
    out, missing = [], set()
    for line in template.splitlines(keepends=True):
        if not line.lstrip().startswith("#"):
            def _sub(m: re.Match) -> str:
                if m.group(1) not in values:
                    missing.add(m.group(1))
                    return m.group(0)
                return str(values[m.group(1)])
            line = _PLACEHOLDER.sub(_sub, line)
        out.append(line)
    if missing:
        raise ValueError(f"unfilled placeholders in the cluster template: {', '.join(sorted(missing))}")
    return "".join(out)


def _unique_free_ports(host: str, n: int, taken: set[int]) -> list[int]:
    out: list[int] = []
    while len(out) < n:
        p = free_port(host)
        if p not in taken and p not in out:
            out.append(p)
    return out


class NatsCluster:
    """`size` nats-servers (JetStream, cluster `dsec`) on `host`; server i is named dsec-<i> (0-based),
    its config is root/nats-<i>.conf, its store root/nats-<i>/ and its log root/nats-<i>.log."""

    def __init__(self, root: Path, host: str = "127.0.0.1", ports: list[int] | None = None,
                 cluster_ports: list[int] | None = None, size: int = 3, template: Path = CLUSTER_CONF,
                 monitor: bool = False, iam=None) -> None:
        """monitor: each server also serves its HTTP monitoring endpoint (/jsz: who leads what) on a free
        loopback port (chaos runs read it). iam: a bus.iam.Iam whose accounts and users every server
        enforces (each config includes its accounts.conf, so `dsec iam` reloads reach all of them); make
        its identities before start(): an account a reload adds to a cluster may not be wired
        (nats-io/nats-server#8560)."""
        if size < 1:
            raise ValueError("a cluster needs at least one server")
        self.root = Path(root)
        self.host, self.size, self.template = host, size, Path(template)
        self.ports = list(ports) if ports is not None else _unique_free_ports(host, size, set(cluster_ports or ()))
        self.cluster_ports = (list(cluster_ports) if cluster_ports is not None
                              else _unique_free_ports(host, size, set(self.ports)))
        if len(self.ports) != size or len(self.cluster_ports) != size:
            raise ValueError(f"ports and cluster_ports need {size} entries each")
        if len(set(self.ports) | set(self.cluster_ports)) != 2 * size:
            raise ValueError("client and cluster ports must all differ")
        self.iam = iam
        self._sweeper = None
        self.monitor_ports = (_unique_free_ports(host, size, set(self.ports) | set(self.cluster_ports))
                              if monitor else [])
        self.servers = [NatsServer(self.root / f"nats-{i}", host=host, port=self.ports[i],
                                   conf=self.root / f"nats-{i}.conf", log_file=self.root / f"nats-{i}.log",
                                   full_conf=True)
                        for i in range(size)]

    # ---- addresses ----------------------------------------------------------------------------

    @property
    def urls(self) -> list[str]:
        """Client URLs, one per server."""
        return [s.url for s in self.servers]

    @property
    def url(self) -> str:
        """All client URLs comma-joined (what Bus.connect and `--nats` accept)."""
        return ",".join(self.urls)

    @property
    def route_urls(self) -> list[str]:
        return [f"nats-route://{self.host}:{p}" for p in self.cluster_ports]

    def name(self, i: int) -> str:
        """Server name of server i (its JetStream peer name)."""
        return f"dsec-{i}"

    def index_of(self, url) -> int:
        """Index of the server serving a client URL (a str or nats-py's `nc.connected_url`)."""
        port = (url if not isinstance(url, str) else urlparse(url)).port
        return self.ports.index(port)

    @property
    def pids(self) -> list[int | None]:
        """Process id of each server (None if never started)."""
        return [s.proc.pid if s.proc is not None else None for s in self.servers]

    def running(self, i: int) -> bool:
        proc = self.servers[i].proc
        return proc is not None and proc.poll() is None

    # ---- configuration ------------------------------------------------------------------------

    def conf_text(self, i: int) -> str:
        """The rendered config of server i."""
        routes = ",\n    ".join(f'"{u}"' for u in self.route_urls)
        return render(self.template.read_text(), {
            "SERVER_NAME": self.name(i), "CLIENT_HOST": self.host, "CLIENT_PORT": str(self.ports[i]),
            "CLUSTER_HOST": self.host, "CLUSTER_PORT": str(self.cluster_ports[i]), "ROUTES": routes,
            "STORE_DIR": str(self.servers[i].store_dir),
        })

    def _write_conf(self, i: int) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        extra = f"\nhttp: {self.host}:{self.monitor_ports[i]}\n" if self.monitor_ports else ""
        if self.iam is not None:   # nats-server includes only relative paths: relative to this config
            accounts = os.path.relpath(self.iam.conf_path, self.servers[i].conf.parent)   # written at start
            extra += f'\n# Identities (written by dsec: `dsec iam`, see bus/iam.py)\ninclude "{accounts}"\n'
        self.servers[i].conf.write_text(self.conf_text(i) + extra)

    def _started(self, i: int) -> None:
        """Server i runs: `dsec iam` reloads it from now on."""
        if self.iam is not None:
            from bus.iamserver import register_server
            register_server(self.iam, self.servers[i].proc.pid, self.servers[i].log_file)

    def jsz(self, i: int, timeout: float = 1.0) -> dict:
        """Server i's /jsz (monitor=True): its JetStream view, the meta group's leader among it."""
        import json
        import urllib.request
        with urllib.request.urlopen(f"http://{self.host}:{self.monitor_ports[i]}/jsz", timeout=timeout) as r:
            return json.load(r)

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> "NatsCluster":
        """Start every server and wait until JetStream is usable cluster-wide: each server answers
        JetStream API requests (meta leader elected) and an R<size> stream can be placed.
        PortInUse / BusUnavailable otherwise, with everything started stopped again.

        Servers are started from the calling thread: they get SIGTERM when it dies (PDEATHSIG)."""
        deadline = time.monotonic() + timeout
        try:
            for i, port in enumerate(self.cluster_ports):
                check_port_free(self.host, port, f"NATS cluster (server {i})")
            if self.iam is not None:
                self.iam.write_conf()   # once: restarts (which may run at once) include the same file
            for i, srv in enumerate(self.servers):
                self._write_conf(i)
                srv.start(timeout=max(1.0, deadline - time.monotonic()))
                self._started(i)
            self._wait_ready(range(self.size), deadline, probe=True)
            if self.iam is not None and self._sweeper is None:   # expired credentials leave the configuration
                from bus.iamserver import ExpirySweeper
                self._sweeper = ExpirySweeper(self.iam.root).start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop every server (SIGTERM to all, then SIGKILL whatever is left after `timeout`); never raises."""
        if self._sweeper is not None:
            self._sweeper.stop()
            self._sweeper = None
        procs = [s.proc for s in self.servers if s.proc is not None]
        for p in procs:
            try:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            except Exception:
                pass
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    p.kill()
                    p.wait()
                except Exception:
                    pass
            except Exception:
                pass

    def kill(self, i: int) -> None:
        """SIGKILL server i (chaos); its store stays for restart(i)."""
        self.servers[i].kill()

    def restart(self, i: int, timeout: float = 30.0) -> None:
        """Start server i again (after kill or stop) with the same config and store; returns once it
        answers JetStream API requests (it has rejoined the meta group; its stream replicas catch up
        in the background). BusUnavailable on timeout (the server is left running)."""
        deadline = time.monotonic() + timeout
        if self.running(i):
            return
        self._write_conf(i)
        srv = self.servers[i]
        while True:   # the route port of a just-killed server can take a moment to free
            try:
                check_port_free(self.host, self.cluster_ports[i], f"NATS cluster (server {i})")
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        srv.start(timeout=max(1.0, deadline - time.monotonic()))
        self._started(i)
        self._wait_ready([i], deadline, probe=False)

    def __enter__(self) -> "NatsCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- readiness ----------------------------------------------------------------------------

    def _admin(self) -> dict:
        """nats.connect's credential arguments for the readiness check: the admin's (auth on)."""
        from bus.creds import credential_options
        return {} if self.iam is None else credential_options(str(self.iam.creds_path("admin")))

    def _wait_ready(self, which, deadline: float, probe: bool) -> None:
        """Run the async readiness check in a helper thread (start() may be called from inside a running
        event loop); the servers themselves are never started from that thread."""
        result: list[BaseException | None] = [None]

        def _run() -> None:
            try:
                asyncio.run(self._ready(list(which), deadline, probe))
            except BaseException as exc:   # handed to the caller
                result[0] = exc

        t = threading.Thread(target=_run, name="nats-cluster-ready", daemon=True)
        t.start()
        t.join(max(0.0, deadline - time.monotonic()) + 10)
        if t.is_alive():
            raise BusUnavailable("NATS cluster readiness check hung")
        if result[0] is not None:
            raise result[0]

    async def _ready(self, which: list[int], deadline: float, probe: bool) -> None:
        import nats
        from nats.js import api

        last: object = "no attempt"
        pending = list(which)
        while pending:
            i = pending[0]
            if not self.running(i):
                raise BusUnavailable(f"nats-server {self.name(i)} exited (see {self.servers[i].log_file})")
            if time.monotonic() > deadline:
                raise BusUnavailable(f"NATS cluster: JetStream not ready on {self.name(i)} "
                                     f"({self.urls[i]}): {last}; logs in {self.root}/nats-*.log")
            left = min(0.5, max(0.1, deadline - time.monotonic()))   # short tries: readiness is seen early
            try:
                nc = await nats.connect(self.urls[i], connect_timeout=min(1.0, left), allow_reconnect=False,
                                        max_reconnect_attempts=0, **self._admin())
            except Exception as exc:
                last = f"{exc.__class__.__name__}: {exc}"
                await asyncio.sleep(0.2)
                continue
            try:
                js = nc.jetstream(timeout=left)
                await js.account_info()
                pending.pop(0)
                if not pending and probe:   # peers known to the meta leader: an R<size> stream can be placed
                    js = nc.jetstream(timeout=min(3.0, max(0.1, deadline - time.monotonic())))
                    await js.add_stream(api.StreamConfig(name=PROBE_STREAM, subjects=["_dsec.cluster.probe"],
                                                         storage=api.StorageType.MEMORY,
                                                         num_replicas=self.size))
                    await js.delete_stream(PROBE_STREAM)
            except Exception as exc:
                last = f"{exc.__class__.__name__}: {exc}"
                if not pending:
                    pending.append(i)   # the probe failed: try it again
                await asyncio.sleep(0.2)
            finally:
                try:
                    await nc.close()
                except Exception:
                    pass
