"""Chaos at scale: a 3-server JetStream cluster, 2 placement engines, 4 local edges and a cloud pool of
2 edges (25 sandboxes each), a burst of creates at once, and optionally one fault mid-burst.

Run: python -m chaos.placement_scale [--creates 300] [--fault none|placement|edge|server]
  placement: SIGKILL one placement engine; edge: SIGKILL one local edge, restart it later;
  server: SIGKILL one nats-server, restart it later.
Every component is a separate process (`dsec placement`, `dsec edge`) connected to its own server of
the cluster. Each create is a batch request (it may burst) that holds its sandbox for --hold seconds
and destroys it. Prints one verdict line:
  verdict: submitted=N completed=N failed=N (reasons) lost=N duplicated=N leaked=N over_capacity=N
           burst_before_threshold=N cloud=N node_lost=N -> PASS|FAIL
- completed: got a sandbox; failed: a typed error at create; node_lost: sandboxes reported lost with the
  killed edge (the client's destroy got SandboxNotFound(node_lost), never a hang);
- lost: a create with no outcome by its deadline; duplicated: a sandbox started twice, or one request
  with two sandboxes (from the event stream); over_capacity: node records (the edges' own accounting,
  watched at every change) showing more sandboxes than declared slots; burst_before_threshold: creates
  routed to the cloud pool while local utilization was below the threshold; leaked: mounts, cgroups or
  processes of any edge left after everything stopped.
PASS needs lost, duplicated, leaked, over_capacity and burst_before_threshold all 0, every create served
(failed=0, whatever the fault), every sandbox of a killed edge reported node_lost, and (without faults)
some work on the cloud pool.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import libdsec
from bus import streams
from bus.cluster import NatsCluster
from bus.conn import Bus, kv_watch
from bus.messages import engine_decoder, event_decoder, sandbox_decoder
from bus.server import die_with_parent
from bus.nodes import decode_node

DSEC = str(Path(sys.executable).parent / "dsec")
TYPED_FAILURES = {"node_lost", "capacity_unavailable", "expired"}
THRESHOLD = 0.8


class Harness:
    """The processes of the scenario and their faults."""

    def __init__(self, tmp: Path, local: int = 4, cloud: int = 2, slots: int = 25, engines: int = 2) -> None:
        self.tmp = tmp
        self.cluster = NatsCluster(tmp / "nats")
        self.slots = slots
        self.edges = {f"loc{i}": "local" for i in range(local)} | {f"cld{i}": "cloud" for i in range(cloud)}
        self.engines_n = engines
        self.procs: dict[str, subprocess.Popen] = {}

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
            raise SystemExit(f"verdict: {name} did not start ({line.strip()!r}; its log ends: {' | '.join(tail)})"
                             " -> FAIL")
        self.procs[name] = proc
        return proc

    def start_edge(self, node: str, index: int) -> None:
        """`dsec edge` for one node, on server index % 3."""
        self._spawn(node, ["edge", "--nats", self.url_for(index), "--node-id", node, "--pool", self.edges[node],
                           "--capacity", f"slots={self.slots}", "--state-dir", str(self.tmp / node)], "dsec: edge")

    async def start(self) -> Bus:
        """Cluster, provisioning (R3), busybox, engines, edges; returns a bus for observing."""
        from cli.stack import ensure_busybox
        self.cluster.start()
        bus = await Bus.connect(self.cluster.url, name="chaos")
        await bus.provision(replicas=3)
        await ensure_busybox(bus, self.tmp / "images")
        starts = [asyncio.to_thread(self._spawn, f"placement{i}", ["placement", "--nats", self.url_for(i),
                                                                 "--state-dir", str(self.tmp / f"placement{i}"),
                                                                 "--burst-threshold", str(THRESHOLD)],
                                    "dsec: placement") for i in range(self.engines_n)]
        starts += [asyncio.to_thread(self.start_edge, node, i) for i, node in enumerate(self.edges)]
        await asyncio.gather(*starts)
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


class Observer:
    """Watches node records (every change) for capacity violations and the burst threshold."""

    def __init__(self, harness: Harness) -> None:
        self.h = harness
        self.nodes: dict = {}
        self.over: list[str] = []
        self.first_over_threshold = 0.0
        self.first_cloud_use = 0.0
        self.cloud_peak = 0

    def on_node(self, key: str, raw: bytes | None, _rev: int) -> None:
        info = decode_node(key, raw)
        if info is None:
            return
        self.nodes[key] = info
        if info.used_slots > info.slots or info.used_slots + len(info.bookings) > info.slots:
            self.over.append(f"{key}: used={info.used_slots} booked={len(info.bookings)} slots={info.slots}")
        local = [i for i in self.nodes.values() if i.pool == "local" and not i.lost]
        cap = sum(i.slots for i in local)
        if cap and not self.first_over_threshold and \
                sum(i.used_slots + len(i.bookings) for i in local) / cap >= THRESHOLD:
            self.first_over_threshold = time.time()
        if info.pool == "cloud" and info.used_slots:
            self.cloud_peak = max(self.cloud_peak, info.used_slots)
            self.first_cloud_use = self.first_cloud_use or time.time()


unanswered: list[str] = []   # sandbox ids of creates that timed out (for the post-mortem below)


async def one(client: libdsec.AsyncClient, hold: float, out: collections.Counter, sandboxes: list) -> None:
    """One create, hold, destroy; record the outcome."""
    try:
        sb = await client.create(priority="batch", timeout=150, ttl=300)
    except libdsec.DsecError as exc:
        key = f"failed:{exc.reason if isinstance(exc, libdsec.SandboxNotFound) else exc.code}"
        if "sandbox_id" in exc.details:
            unanswered.append(str(exc.details["sandbox_id"]))
        if out[key] == 0:
            print(f"  first {key}: {exc}", file=sys.stderr)
        out[key] += 1
        return
    out["completed"] += 1
    sandboxes.append(sb.id)
    await asyncio.sleep(hold)
    try:
        await sb.destroy(timeout=60)
    except libdsec.SandboxNotFound as exc:
        out[f"sandbox:{exc.reason}"] += 1
    except libdsec.DsecError as exc:
        if out[f"sandbox:{exc.code}"] == 0:
            print(f"  first destroy failure {exc.code}: {exc}", file=sys.stderr)
        out[f"sandbox:{exc.code}"] += 1


async def scenario(creates: int, fault: str, hold: float, tmp: Path) -> int:
    """Returns the exit code (0 on PASS)."""
    from edge.backends.container import leftovers
    h = Harness(tmp)
    obs = Observer(h)
    out: collections.Counter = collections.Counter()
    sandboxes: list[str] = []
    lost = duplicated = 0
    burst_low = 0
    lost_events: set[str] = set()
    running_on_victim = 0
    victim = ""
    stuck: list[str] = []
    t0 = time.monotonic()
    try:
        bus = await h.start()
        watch = await kv_watch(bus, streams.NODES_KV, obs.on_node)
        async with libdsec.AsyncClient(h.cluster.url) as client:
            tasks = [asyncio.create_task(one(client, hold, out, sandboxes)) for _ in range(creates)]
            while out["completed"] < creates // 4 and not all(t.done() for t in tasks):
                await asyncio.sleep(0.01)
            if fault == "placement":
                h.kill("placement0")
            elif fault == "edge":
                victim = max((n for n in h.edges if h.edges[n] == "local"),
                             key=lambda n: obs.nodes[n].used_slots if n in obs.nodes else 0)
                running_on_victim = obs.nodes[victim].used_slots if victim in obs.nodes else 0
                h.kill(victim)
                # down long enough to be declared lost (its sandboxes node_lost, its queued creates placed
                # again, its pending ops answered); then it comes back, reconciles, and serves again
                await asyncio.sleep(streams.NODE_LOST_AFTER + 3.0)
                await asyncio.to_thread(h.start_edge, victim, 0)
            elif fault == "server":
                h.cluster.kill(1)
                await asyncio.sleep(3.0)
                await asyncio.to_thread(h.cluster.restart, 1)
            done, pending = await asyncio.wait(tasks, timeout=200)
            lost = len(pending)
            for t in pending:
                t.cancel()
        created: dict[str, int] = collections.Counter()
        async for data in bus.read_subject(streams.EVT_STREAM, "dsec.evt.>", timeout=5):
            ev = event_decoder.decode(data)
            if ev.type == "created":
                created[ev.sandbox_id] += 1
            elif ev.type == "node_lost":
                lost_events.add(ev.sandbox_id)
        duplicated = sum(n - 1 for n in created.values() if n > 1) + (len(sandboxes) - len(set(sandboxes)))
        if fault == "edge":   # every sandbox the dead edge ran ended (destroyed or node_lost), none hangs
            for _, raw in await bus.kv_items(streams.SANDBOXES_KV):
                rec = sandbox_decoder.decode(raw)
                if rec.node == victim and rec.state in ("ready", "starting"):
                    stuck.append(rec.sandbox_id)
        for sid in unanswered[:10]:   # what the system knows of a create nobody answered
            raw = await bus.kv_get(streams.SANDBOXES_KV, sid)
            evs = [event_decoder.decode(d) async for d in bus.read_subject(streams.EVT_STREAM, f"dsec.evt.*.{sid}")]
            print(f"  unanswered {sid}: record={raw!r} events={[(e.type, e.node, e.detail) for e in evs]}",
                  file=sys.stderr)
        for _, raw in await bus.kv_items(streams.ENGINES_KV):
            e = engine_decoder.decode(raw)
            if e.bursted and e.burst_min_utilization < THRESHOLD:
                burst_low += 1
        watch.cancel()
        await bus.close()
    finally:
        h.stop()
    leaked = sum(len(leftovers(tmp / node / "edge", node)) for node in h.edges)
    failed = {k.split(":", 1)[1]: v for k, v in out.items() if k.startswith("failed:")}
    untyped = sum(v for k, v in failed.items() if k not in TYPED_FAILURES)
    untyped += sum(v for k, v in out.items() if k.startswith("sandbox:") and k != "sandbox:node_lost")
    node_lost = len(lost_events)
    # every create must be served, whatever the fault (a create can wait out any of them); and without
    # a fault nothing is lost and the cloud pool takes the overflow
    clean = not failed and (fault != "none" or (node_lost == 0 and obs.cloud_peak > 0))
    if fault == "edge" and (stuck or (running_on_victim and not node_lost)):
        clean = False   # the dead edge's sandboxes must be reported node_lost (or have been destroyed)
    burst_order_ok = not obs.first_cloud_use or obs.first_cloud_use >= obs.first_over_threshold > 0
    ok = (lost == 0 and duplicated == 0 and leaked == 0 and untyped == 0 and not obs.over and burst_low == 0
          and burst_order_ok and clean and out["completed"] + sum(failed.values()) == creates)
    if obs.over:
        print("  over capacity: " + "; ".join(obs.over[:5]), file=sys.stderr)
    print(f"verdict: fault={fault} submitted={creates} completed={out['completed']} failed={sum(failed.values())} "
          f"({', '.join(f'{k}={v}' for k, v in sorted(failed.items())) or 'none'}) lost={lost} "
          f"duplicated={duplicated} leaked={leaked} over_capacity={len(obs.over)} "
          f"burst_before_threshold={burst_low + (not burst_order_ok)} cloud_peak={obs.cloud_peak} "
          f"node_lost={node_lost} (victim ran ~{running_on_victim}, stuck={len(stuck)}) untyped={untyped} "
          f"seconds={time.monotonic() - t0:.1f} "
          f"-> {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def main() -> None:
    """Parse arguments and run the scenario in a temp dir."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--creates", type=int, default=300, help="creates submitted at once (default 300)")
    ap.add_argument("--fault", choices=["none", "placement", "edge", "server"], default="none")
    ap.add_argument("--hold", type=float, default=1.0, help="seconds each sandbox is held (default 1)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs) afterwards")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="dsec-chaos-"))
    try:
        code = asyncio.run(scenario(args.creates, args.fault, args.hold, tmp))
    finally:
        if not args.keep:
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"  logs in {tmp}", file=sys.stderr)
    raise SystemExit(code)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
