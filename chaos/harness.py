"""The processes of a cluster chaos scenario and their faults: a 3-server JetStream cluster, placement
engines and edges as separate `dsec` processes, each talking to one server of the cluster (it learns the
others from it, for failover). Identities are on, as in production: every server enforces the accounts
made here before it starts, each engine and edge connects as its own principal, the clients as the
default tenant and the observer as the admin.

Faults: SIGKILL (and restart) a server, the leader of a stream or of the meta group, an edge (restarted
once its record says lost), an engine; SIGSTOP a server for a while (the bus sick, nobody dead).
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bus.cluster import NatsCluster
from bus.conn import Bus
from bus.errors import AuthenticationFailed, BusError
from bus.server import die_with_parent

DSEC = str(Path(sys.executable).parent / "dsec")
TRACKED = ["DSEC_REQ", "DSEC_NODE", "DSEC_OUT", "DSEC_EVT", "DSEC_TRAJ", "KV_dsec-sandboxes", "KV_dsec-nodes"]
CONSUMERS_OF = ["DSEC_REQ", "DSEC_NODE"]   # their durable consumers (placement's, the edges' lanes) elect too


class Harness:
    """The processes of a scenario; every component is a separate process, as on separate machines."""

    def __init__(self, tmp: Path, local: int = 4, cloud: int = 1, slots: int = 25, engines: int = 2,
                 threshold: float = 0.8) -> None:
        from bus import iam
        self.tmp = tmp
        self.slots = slots
        self.threshold = threshold
        self.edges = {f"loc{i}": "local" for i in range(local)} | {f"cld{i}": "cloud" for i in range(cloud)}
        for pool in sorted(set(self.edges.values())):   # every identity before any server starts
            self.iam = iam.bootstrap(tmp / "iam", nodes=[n for n, p in self.edges.items() if p == pool], pool=pool)
        self.cluster = NatsCluster(tmp / "nats", monitor=True, iam=self.iam)
        self.engines = [f"placement{i}" for i in range(engines)]
        self.procs: dict[str, subprocess.Popen] = {}
        self.server_of: dict[str, int] = {}

    def creds(self, principal: str) -> str:
        """A principal's credential file (`admin`, `placement`, `edge-<node>`, `tenant:default`)."""
        return str(self.iam.creds_path(principal))

    @property
    def tenant_creds(self) -> str:
        """The clients' credential: the default tenant's."""
        return self.creds("tenant:default")

    def url_for(self, i: int) -> str:
        """The one server a component talks to (it discovers the others from it for failover)."""
        return self.cluster.urls[i % self.cluster.size]

    def _spawn(self, name: str, args: list[str], ready: str) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "ab")
        # dies with this thread: a harness killed mid-run leaves no component behind
        proc = subprocess.Popen([DSEC, *args], stdout=subprocess.PIPE, stderr=log, text=True,
                                preexec_fn=die_with_parent)
        log.close()
        line = proc.stdout.readline()
        if not line.startswith(ready):
            tail = (self.tmp / f"{name}.log").read_text(errors="replace").strip().splitlines()[-6:]
            proc.kill()
            raise SystemExit(f"verdict: {name} did not start ({line.strip()!r}; its log ends: {' | '.join(tail)})"
                             " -> FAIL")
        self.procs[name] = proc
        return proc

    def start_edge(self, node: str) -> None:
        """`dsec edge` for one node, on its server."""
        i = list(self.edges).index(node)
        self.server_of[node] = i % self.cluster.size
        self._spawn(node, ["edge", "--nats", self.url_for(i), "--node-id", node, "--pool", self.edges[node],
                           "--capacity", f"slots={self.slots}", "--backend", "container",
                           "--state-dir", str(self.tmp / node), "--creds", self.creds(f"edge-{node}")], "dsec: edge")

    def start_engine(self, name: str) -> None:
        """`dsec placement`, on its server."""
        i = self.engines.index(name)
        self.server_of[name] = i % self.cluster.size
        self._spawn(name, ["placement", "--nats", self.url_for(i), "--state-dir", str(self.tmp / name),
                           "--burst-threshold", str(self.threshold), "--creds", self.creds("placement")],
                    "dsec: placement")

    async def start(self) -> Bus:
        """Cluster, provisioning (R3), busybox, engines, edges; returns a bus for observing."""
        from cli.stack import ensure_busybox
        self.cluster.start()
        try:   # identities are enforced: a client without a credential is refused
            anon = await Bus.connect(self.cluster.url, name="chaos-anonymous", timeout=3.0, reconnect=False)
        except AuthenticationFailed:
            pass
        else:
            await anon.close()
            raise SystemExit("verdict: the cluster let a client without a credential in -> FAIL")
        bus = await Bus.connect(self.cluster.url, name="chaos", creds=self.creds("admin"))
        await bus.provision(replicas=3)
        await ensure_busybox(bus, self.tmp / "images")
        await asyncio.gather(*(asyncio.to_thread(self.start_engine, e) for e in self.engines),
                             *(asyncio.to_thread(self.start_edge, n) for n in self.edges))
        return bus

    def kill(self, name: str) -> None:
        """SIGKILL one component."""
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def stop(self) -> None:
        """SIGINT everything (edges destroy their sandboxes), then the cluster."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for name, proc in self.procs.items():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                print(f"  {name} did not stop in 20 s", file=sys.stderr)
                proc.kill()
                proc.wait()
        self.cluster.stop()

    # ---- the cluster's leaders ------------------------------------------------------------------------

    async def leaders(self, bus: Bus) -> dict[str, str]:
        """Leader (server name) of each tracked stream and of the meta group ('' while there is none)."""
        out: dict[str, str] = {}
        js = bus.nc.jetstream(timeout=0.5)   # short: a stream without a leader does not answer

        async def one(name: str) -> None:
            try:
                out[name] = (await js.stream_info(name)).cluster.leader or ""
            except Exception:
                out[name] = ""
        async def consumers(stream: str) -> None:
            try:
                for c in await js.consumers_info(stream):
                    out[f"{stream}/{c.name}"] = (c.cluster.leader if c.cluster else "") or ""
            except Exception:
                pass
        await asyncio.gather(*(one(n) for n in TRACKED), *(consumers(s) for s in CONSUMERS_OF))
        out["meta"] = await asyncio.to_thread(self.meta_leader)
        return out

    def meta_leader(self) -> str:
        """The meta group's leader as the live servers see it ('' while they see none)."""
        for i in range(self.cluster.size):
            if self.cluster.running(i):
                try:
                    return (self.cluster.jsz(i).get("meta_cluster") or {}).get("leader", "") or ""
                except Exception:
                    continue
        return ""

    async def server_leading(self, bus: Bus, what: str) -> int:
        """Index of the server leading a stream (or 'meta')."""
        leader = (await self.leaders(bus)).get(what, "")
        return int(leader.rsplit("-", 1)[1]) if leader.startswith("dsec-") else 0

    async def server_leading_nothing(self, bus: Bus) -> int:
        """A server leading none of the tracked streams, their consumers, nor the meta group: found, or made
        by stepping leaders down away from one (that server then takes nothing tracked)."""
        for _ in range(20):
            leaders = await self.leaders(bus)
            led = {name for name in leaders.values() if name}
            free = [i for i in range(self.cluster.size) if self.cluster.name(i) not in led]
            if free:
                return free[-1]
            target = next(self.cluster.name(i) for i in reversed(range(self.cluster.size))
                          if self.cluster.name(i) != leaders["meta"])
            for what, leader in leaders.items():
                if leader == target and what != "meta":
                    stream, _, consumer = what.partition("/")
                    subject = (f"$JS.API.CONSUMER.LEADER.STEPDOWN.{stream}.{consumer}" if consumer
                               else f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}")
                    try:
                        await bus.nc.request(subject, b"", timeout=3)
                    except Exception:
                        pass
            await asyncio.sleep(1.0)
        raise SystemExit("verdict: no server could be made to lead nothing -> FAIL")

    async def elected(self, bus: Bus, victim: int, since: float, limit: float = 30.0) -> float:
        """Seconds from `since` until every tracked stream, its consumers and the meta group have a leader
        again (not the victim while it is down): the servers' own recovery; -1 after limit."""
        name = self.cluster.name(victim)
        while time.monotonic() - since < limit:
            leaders = await self.leaders(bus)
            if all(v and (v != name or self.cluster.running(victim)) for v in leaders.values()):
                return time.monotonic() - since
            await asyncio.sleep(0.1)
        return -1.0

    def pause(self, i: int) -> None:
        """SIGSTOP server i: it holds its connections and answers nothing."""
        os.kill(self.cluster.servers[i].proc.pid, signal.SIGSTOP)

    def resume(self, i: int) -> None:
        """SIGCONT server i."""
        os.kill(self.cluster.servers[i].proc.pid, signal.SIGCONT)


async def node_lost(bus: Bus, node: str, limit: float = 60.0) -> bool:
    """Wait until a node's record says lost."""
    from bus import streams
    from bus.nodes import decode_node
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            info = decode_node(node, await bus.kv_get(streams.NODES_KV, node))
            if info is not None and info.lost:
                return True
        except BusError:
            pass
        await asyncio.sleep(0.1)
    return False
