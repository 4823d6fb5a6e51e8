"""Everything `dsec up` runs, in one object: embedded NATS, provisioning, busybox, placement, edge, metrics."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
from pathlib import Path

from bus.conn import Bus
from bus.creds import creds_path, creds_principal
from bus.errors import BusUnavailable, EnvironmentFailure, ImageNotFound
from bus.server import NatsServer, check_port_free
from edge.capacity import EdgeConfig
from edge.erofs import LayerBuildError, busybox_rootfs, pack_dir
from bus.images import ImageRegistry

log = logging.getLogger(__name__)

EDGE_STOP_BUDGET = 6.0   # seconds; with the rest, everything is gone within 10 s of a stop signal


async def ensure_busybox(bus: Bus, work_dir: Path) -> bool:
    """Import `busybox` (from the host's busybox-static) if the store lacks it; True when it was imported."""
    registry = ImageRegistry(bus)
    try:
        await registry.resolve("busybox", cache_for=0)
        return False
    except ImageNotFound:
        pass
    work_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        root, layer = Path(tmp) / "root", Path(tmp) / "busybox.erofs"
        try:
            await asyncio.to_thread(busybox_rootfs, root)
            digest = await asyncio.to_thread(pack_dir, root, layer)
        except LayerBuildError as exc:
            raise EnvironmentFailure(f"cannot import busybox: {exc}") from exc
        await registry.publish("busybox", layer, digest)   # (a twin starting at once publishes the same digest)
    return True


class Stack:
    """One node's worth of DSec in one process."""

    def __init__(self, state_dir: Path, *, nats_url: str | None = None, host: str = "127.0.0.1", port: int = 4222,
                 metrics_port: int | None = 9464, edge_config: EdgeConfig | None = None,
                 run_edge: bool = True, run_placement: bool = True, placement_options: dict | None = None,
                 servers: int = 1, stream_ages: dict[str, float] | None = None,
                 backends: list | None = None, optional_kinds: frozenset[str] = frozenset(),
                 auth: bool = False, creds: str | None = None) -> None:
        """auth: an embedded server enforces identities (bus/iam.py; `dsec up` turns it on and makes them
        under the state dir); creds: the credential of the part this stack runs against an external server (an edge's or
        a placement engine's), default the one under the state dir, else $DSEC_CREDS."""
        self.state_dir = Path(state_dir).resolve()
        self.external_url = nats_url
        self.host, self.port, self.metrics_port = host, port, metrics_port
        self.edge_config = edge_config or EdgeConfig()
        self.backends = backends   # backend configs (edge/backends/registry.py); None: the container one
        self.optional_kinds = optional_kinds   # found, not asked for: one that fails to start is left out
        self.run_edge, self.run_placement = run_edge, run_placement
        self.placement_options = placement_options or {}
        self.servers = servers       # > 1: an embedded JetStream cluster of that many servers (R3 streams)
        self.stream_ages = stream_ages or {}   # stream -> max age (s) the operator set; others keep theirs
        self.auth, self.creds = auth, creds
        self.iam = None
        self.cluster = None
        self.server: NatsServer | None = None
        self.bus: Bus | None = None      # the stack's own connection: provisioning, metrics (admin with auth)
        self._buses: list[Bus] = []      # each part's own connection, as its own principal (auth on)
        self._main: tuple[str | None, str] = (None, "")   # the stack's own connection's credential, principal
        self.edge = None
        self.placement = None
        self._metrics = None
        self._locks: list = []
        self.broken = asyncio.Event()   # a part lost its connection for good and cannot go on (broken_reason)
        self.broken_reason = ""
        self._watcher: asyncio.Future | None = None
        self._keeper: asyncio.Future | None = None   # starts the embedded server again if it exits

    @property
    def url(self) -> str:
        """The NATS URL clients use (comma-separated for a cluster)."""
        if self.external_url:
            return self.external_url
        if self.servers > 1:
            return ",".join(f"nats://{self.host}:{self.port + i}" for i in range(self.servers))
        return f"nats://{self.host}:{self.port}"

    async def start(self) -> None:
        """Start every part; on failure, stop what started and re-raise."""
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        from cli.locks import node_lock, state_lock
        if self.metrics_port:   # ports first: a taken port is the likelier, clearer error
            check_port_free(self.host, self.metrics_port, "metrics")
        if self.external_url is None:
            for i in range(self.servers):
                check_port_free(self.host, self.port + i, "NATS")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._locks.append(state_lock(self.state_dir).acquire())
        if self.run_edge:
            self._locks.append(node_lock(self.edge_config.node_id).acquire())
        if self.external_url is None and self.auth:   # before the servers start (nats-server#8560)
            from bus import iam
            self.iam = iam.bootstrap(self.state_dir, nodes=[self.edge_config.node_id] if self.run_edge else [],
                                      pool=self.edge_config.pool)
        if self.external_url is None and self.servers > 1:
            from bus.cluster import NatsCluster
            self.cluster = NatsCluster(self.state_dir / "nats-cluster", self.host, size=self.servers,
                                       ports=[self.port + i for i in range(self.servers)], iam=self.iam)
            self.cluster.start()   # from this thread (parent-death signal); blocks about a second
            self._keeper = asyncio.ensure_future(self._keep_server())
        elif self.external_url is None:
            self.server = NatsServer(self.state_dir / "nats", self.host, self.port, iam=self.iam)
            self.server.start()   # from this thread: the server's parent-death signal is tied to it
            self._keeper = asyncio.ensure_future(self._keep_server())
        main, principal = self._main = self._main_creds()
        self.bus = await Bus.connect(self.url, name="dsec-up", creds=main)
        if principal in ("", "admin", "placement"):   # an edge's credential cannot (and need not) provision
            await self.bus.provision(replicas=min(3, self.servers))
            for name, age in self.stream_ages.items():
                await self.bus.set_stream_age(name, age)
            await ensure_busybox(self.bus, self.state_dir / "tmp")
        if self.run_placement:
            from placement.engine import PlacementEngine
            self.placement = PlacementEngine(await self._bus_as("placement"), **self.placement_options)
            await self.placement.start()
        if self.run_edge:
            from edge.agent import Edge
            from edge.backends.registry import BackendSet, config_for
            configs = self.backends or [config_for("container")]
            backend = BackendSet.build(configs, self.state_dir / "edge", self.edge_config.node_id,
                                       self.optional_kinds)
            self.edge = Edge(await self._bus_as(f"edge-{self.edge_config.node_id}"), backend, self.edge_config,
                             self.state_dir / "edge")
            await self.edge.start()
        if self.metrics_port:
            from cli.metrics import serve
            self._metrics = serve(self, self.host, self.metrics_port)
        self._watcher = asyncio.ensure_future(self._watch())

    def _parts(self) -> dict[str, Bus]:
        parts = {"placement": self.placement.bus if self.placement else None,
                 "edge": self.edge.bus if self.edge else None, "dsec up": self.bus}
        return {part: bus for part, bus in parts.items() if bus is not None}

    async def _watch(self) -> None:
        """nats-py never reconnects a connection it gave up for good (Bus.cut: the server sent a protocol
        error). A placement engine on a connection of its own, or sharing the stack's in a stack without an
        edge, is started again on a new one (it keeps no state of its own); any other part's loss breaks the stack: `broken` is set, saying which part and
        why (`dsec up` then stops and exits non-zero rather than serve on deaf)."""
        while True:
            parts = self._parts()
            waits = {asyncio.ensure_future(bus.cut.wait()): bus for bus in set(parts.values())}
            try:
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
            bus = waits[next(iter(done))]
            names = [part for part, b in parts.items() if b is bus]
            if "placement" in names and self.edge is None or names == ["placement"]:
                try:
                    await self._restart_placement(bus)
                    continue
                except Exception as exc:
                    bus.cut_reason += f"; starting it again failed: {exc}"
            self.broken_reason = (f"{' and '.join(names)}: the NATS server closed the connection and it cannot "
                                  f"be reconnected ({bus.cut_reason})")
            log.error("%s", self.broken_reason)
            self.broken.set()
            return

    async def _keep_server(self) -> None:
        """The embedded server (each of an embedded cluster's), started again whenever it exits (every part
        reconnects to it; a killed cluster member stayed down for good, a zombie of `dsec up`: helper 28);
        if one keeps exiting or cannot start, it is left down; once fewer than a majority run (the single server:
        it), the stack is broken (`dsec up` stops and exits non-zero, saying why). One member of three restarted
        three times in a minute stopped the whole cluster, sandboxes destroyed, though two served (helper-42)."""
        servers = self.cluster.servers if self.cluster is not None else [self.server]
        keeping = {asyncio.ensure_future(s.keep()) for s in servers}
        majority = len(servers) // 2 + 1
        try:
            while True:   # a cluster serves on while a majority of its servers run (one given up on stays down)
                done, keeping = await asyncio.wait(keeping, return_when=asyncio.FIRST_COMPLETED)
                why = next(iter(done)).result()
                if len(keeping) < majority:
                    self.broken_reason = why
                    break
                log.error("%s; the cluster's other %d servers hold its majority: serving on without it (restart "
                          "`dsec up` to start it again)", why, len(keeping))
        except Exception as exc:   # (not a way it should end: said, not left in a task nobody reads)
            self.broken_reason = f"watching the NATS server failed: {exc!r}"
        finally:
            for k in keeping:
                k.cancel()
            await asyncio.gather(*keeping, return_exceptions=True)
        log.error("%s", self.broken_reason)
        self.broken.set()

    async def _restart_placement(self, cut: Bus) -> None:
        """The engine again on a new connection; when it shared the stack's own (a stack that runs no edge,
        as `dsec placement --creds FILE` does), that one is made again first."""
        from placement.engine import PlacementEngine
        log.error("placement: the NATS server closed its connection (%s); starting it again", cut.cut_reason)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.placement.stop(), 2)
        if cut in self._buses:
            self._buses.remove(cut)
        await cut.close()
        self.placement = None
        for _ in range(30):
            try:
                if self.bus is cut:
                    self.bus = await Bus.connect(self.url, name="dsec-up", creds=self._main[0])
                bus = await self._bus_as("placement")
                break
            except BusUnavailable:
                await asyncio.sleep(1)
        else:
            raise BusUnavailable("no connection to NATS within 30 s")
        self.placement = PlacementEngine(bus, **self.placement_options)
        await self.placement.start()
        log.warning("placement: serving again on a new connection")

    def tenant_creds(self, tenant: str = "default") -> str | None:
        """A tenant's credential under the state dir (None without auth)."""
        return self._creds(f"tenant:{tenant}")

    def _creds(self, principal: str) -> str | None:
        """A principal's credential under the state dir, if there is one."""
        path = creds_path(self.state_dir, principal)
        return str(path) if path.exists() else None

    def _main_creds(self) -> tuple[str | None, str]:
        """The stack's own connection's credential and principal: admin where this state dir has it, else
        the part it runs (--creds, the state dir's, $DSEC_CREDS); (None, "") without auth."""
        own = f"edge-{self.edge_config.node_id}" if self.run_edge and not self.run_placement else "placement"
        found = self.creds or self._creds("admin") or self._creds(own) or os.environ.get("DSEC_CREDS")
        if not found:
            return None, ""
        try:
            return found, creds_principal(Path(found).read_text()) or "admin"
        except OSError:
            return found, ""   # connecting says what is wrong with it

    async def _bus_as(self, role: str) -> Bus:
        """A connection as one part's own principal when the state dir (or --creds) has its credential;
        else the stack's own connection."""
        creds = self._creds(role) if self.creds is None else self.creds
        if creds is None or self.bus is None or creds == self._main[0]:
            return self.bus
        bus = await Bus.connect(self.url, name=f"dsec-{role}", creds=creds)
        self._buses.append(bus)
        return bus

    async def stop(self) -> None:
        """Destroy every sandbox, stop every part; the NATS server stops last. Never raises."""
        if self._keeper is not None:
            self._keeper.cancel()
            await asyncio.gather(self._keeper, return_exceptions=True)
            self._keeper = None
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
            self._watcher = None
        if self._metrics is not None:
            with contextlib.suppress(Exception):
                self._metrics.shutdown()
                self._metrics.server_close()
            self._metrics = None
        if self.edge is not None:
            try:
                await asyncio.wait_for(self.edge.stop(), EDGE_STOP_BUDGET)
            except Exception as exc:   # whatever happened, the rest must still stop
                log.error("edge stop incomplete: %s", exc)
            self.edge = None
        if self.placement is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.placement.stop(), 0.5)
            self.placement = None
        for bus in self._buses:
            await bus.close()
        self._buses.clear()
        if self.bus is not None:
            await self.bus.close()
            self.bus = None
        if self.server is not None:
            await asyncio.to_thread(self.server.stop, 1.5)
            self.server = None
        if self.cluster is not None:
            await asyncio.to_thread(self.cluster.stop, 1.5)
            self.cluster = None
        for lock in self._locks:
            lock.release()
        self._locks.clear()
