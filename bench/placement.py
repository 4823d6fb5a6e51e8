"""Benchmark: placement throughput and latency, and a burst of real sandboxes.

Run: python -m bench.placement [--creates 3000] [--rate 500] [--burst 1000]
1. Placement alone: a nats-server, 8 edges with the in-process no-op backend (one process), and 1 then
   2 `dsec placement` engines (separate processes). For each engine count:
   - saturation: --creates requests submitted at once; placements/s (requests routed to a node lane per
     second, counted from the engines' own figures) and ready/s end to end;
   - below saturation: --rate requests/s for 4 s, open loop; placement latency p50/p99, from the client's
     send to the placed request appearing on its node's lane (watched on the lanes' core subjects).
2. Burst (--burst N, 0 to skip): a separate `dsec up` (real container edge, 128 slots), N creates at once,
   each destroyed once ready: time until all were ready, peak queue depth (waiting + held on the
   placement consumers), and the resident memory of `dsec up` and its nats-server before, at the
   deepest queue, and after.
The raw baseline of this machine (an in-process JetStream publish-with-ack round trip) is measured in
the same run, and latencies are also given as multiples of it.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import psutil

import libdsec
from bus import streams
from bus.conn import Bus
from bus.messages import CreateRequest
from bus.records import engine_decoder
from bus.server import NatsServer, die_with_parent, free_port
from cli.demo import percentile

DSEC = str(Path(sys.executable).parent / "dsec")


def spawn(args: list[str], ready: str, log: Path) -> subprocess.Popen:
    """A child process; returns once it printed its ready line."""
    with open(log, "ab") as f:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=f, text=True, preexec_fn=die_with_parent)
    line = proc.stdout.readline()
    if not line.startswith(ready):
        proc.kill()
        raise SystemExit(f"bench: {args[0]} did not start ({line.strip()!r}; see {log})")
    return proc


def stop(proc: subprocess.Popen) -> None:
    """SIGINT, then wait (SIGKILL after 20 s)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def baseline(bus: Bus, n: int = 300) -> float:
    """p50 ms of a JetStream publish-with-ack (the bus's own round trip)."""
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        await bus.publish("dsec.evt.bench.baseline", b"{}")
        out.append((time.perf_counter() - t0) * 1e3)
    return percentile(out, 50)


class LaneWatch:
    """Times each placed create from its client send to its arrival on a node lane."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.arrivals: list[float] = []
        self._dec = msgspec.json.Decoder(CreateRequest)

    async def open(self, bus: Bus) -> None:
        async def cb(data: bytes, _subject: str) -> None:
            now = time.time()
            req = self._dec.decode(data)
            self.latencies.append((now - req.sent_at) * 1e3)
            self.arrivals.append(now)
        await bus.subscribe("dsec.node.*.create", cb)

    def reset(self) -> None:
        self.latencies, self.arrivals = [], []


async def engines_figures(bus: Bus) -> str:
    """What the live engines say they did: compare-and-set conflicts and creates taken back."""
    conflicts = taken = 0
    for _, raw in await bus.kv_items(streams.ENGINES_KV):
        e = engine_decoder.decode(raw)
        conflicts, taken = conflicts + e.conflicts, taken + getattr(e, "taken_back", 0)
    return f"booking conflicts {conflicts}, creates taken back {taken}"


async def engines_placed(bus: Bus) -> int:
    """Requests routed so far, summed over the live engines' published figures."""
    total = 0
    for _, raw in await bus.kv_items(streams.ENGINES_KV):
        total += engine_decoder.decode(raw).placed
    return total


async def saturation(client: libdsec.AsyncClient, watch: LaneWatch, n: int) -> dict:
    """n creates at once: routed/s (lane arrivals) and ready/s."""
    watch.reset()
    t0 = time.time()
    results = await asyncio.gather(*(client.create(backend="noop", timeout=120, ttl=3600) for _ in range(n)), return_exceptions=True)
    t1 = time.time()
    errors = [r for r in results if isinstance(r, BaseException)]
    span = (max(watch.arrivals) - t0) if watch.arrivals else float("nan")
    return {"placed_per_s": len(watch.arrivals) / span, "ready_per_s": (n - len(errors)) / (t1 - t0),
            "errors": len(errors), "lat_p50": percentile(watch.latencies, 50),
            "lat_p99": percentile(watch.latencies, 99)}


async def paced(client: libdsec.AsyncClient, watch: LaneWatch, rate: float, seconds: float = 4.0) -> dict:
    """Open loop at `rate`/s: placement latency below saturation."""
    watch.reset()
    tasks = []
    t0 = time.monotonic()
    for i in range(int(rate * seconds)):
        delay = t0 + i / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(client.create(backend="noop", timeout=60, ttl=3600)))
    results = await asyncio.gather(*tasks, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    return {"rate": rate, "lat_p50": percentile(watch.latencies, 50), "lat_p99": percentile(watch.latencies, 99),
            "errors": len(errors)}


async def placement_only(tmp: Path, creates: int, rate: float, auth: bool = True) -> None:
    """Section 1. With auth, the server enforces identities as `dsec up` does: the engines connect as
    placement, the client as the default tenant (through its account's imports); the no-op edges, a
    bench fake, as admin."""
    from bus import iam
    from cli.stack import ensure_busybox
    ids = iam.bootstrap(tmp / "iam", tenants=["default"]) if auth else None
    creds = (lambda who: str(ids.creds_path(who))) if ids else (lambda who: None)
    srv = NatsServer(tmp / "nats", port=free_port(), iam=ids).start()
    print(f"identities: {'on' if auth else 'off (--no-auth)'}")
    bus = await Bus.connect(srv.url, name="bench", creds=creds("admin"))
    await bus.provision()
    await ensure_busybox(bus, tmp / "img")
    base = await baseline(bus)
    edges = spawn([sys.executable, "-m", "bench.noop_edges", "--nats", srv.url, "--count", "8",
                   "--state-dir", str(tmp / "edges"), *(["--creds", creds("admin")] if auth else [])],
                  "ready", tmp / "edges.log")
    engines: list[subprocess.Popen] = []
    watch = LaneWatch()
    await watch.open(bus)
    print(f"raw baseline: JetStream publish-with-ack p50 {base:.3f} ms")
    try:
        async with libdsec.AsyncClient(srv.url, creds=creds("tenant:default")) as client:
            for n_engines in (1, 2):
                while len(engines) < n_engines:
                    engines.append(spawn([DSEC, "placement", "--nats", srv.url, "--state-dir",
                                          str(tmp / f"p{len(engines)}"), "--max-waiting", "256",
                                          *(["--creds", creds("placement")] if auth else [])],
                                         "dsec: placement", tmp / f"placement{len(engines)}.log"))
                await saturation(client, watch, 200)   # warm-up
                sat = await saturation(client, watch, creates)
                low = await paced(client, watch, rate)
                print(f"{n_engines} engine(s), 8 no-op edges: saturation {creates} at once: "
                      f"{sat['placed_per_s']:.0f} placements/s, {sat['ready_per_s']:.0f} ready/s, "
                      f"errors={sat['errors']} (latency under that backlog p50 {sat['lat_p50']:.1f} ms "
                      f"p99 {sat['lat_p99']:.1f} ms)")
                print(f"{n_engines} engine(s), below saturation at {rate:.0f}/s: placement latency "
                      f"p50 {low['lat_p50']:.2f} ms ({low['lat_p50'] / base:.1f}x baseline) "
                      f"p99 {low['lat_p99']:.2f} ms ({low['lat_p99'] / base:.1f}x baseline) errors={low['errors']}")
                print(f"{n_engines} engine(s), so far: {await engines_figures(bus)}")
    finally:
        for p in engines:
            stop(p)
        stop(edges)
        await bus.close()
        srv.stop()


def rss(proc: psutil.Process) -> dict[str, int]:
    """Resident bytes of `dsec up` and of each child (its nats-server)."""
    out = {"dsec up": proc.memory_info().rss}
    for child in proc.children(recursive=True):
        try:
            if "nats-server" in child.name():
                out["nats-server"] = child.memory_info().rss
        except psutil.Error:
            pass
    return out


async def burst(tmp: Path, n: int, auth: bool = True) -> None:
    """Section 2."""
    port = free_port()
    up = spawn([DSEC, "up", "--port", str(port), "--metrics-port", "0", "--node-id", "bench-burst",
                "--slots", "128", "--state-dir", str(tmp / "up"), *([] if auth else ["--no-auth"])],
               "dsec: ready", tmp / "up.log")
    url = f"nats://127.0.0.1:{port}"
    proc = psutil.Process(up.pid)
    creds = (lambda p: str(tmp / "up" / "creds" / p)) if auth else (lambda p: None)
    try:
        bus = await Bus.connect(url, name="bench-burst", creds=creds("admin.creds"))
        async with libdsec.AsyncClient(url, creds=creds("tenants/default.creds")) as client:
            warm = await client.create_many(8)
            await asyncio.gather(*(s.destroy() for s in warm))
            await asyncio.sleep(1)
            before = rss(proc)
            peak = {"depth": 0, "rss": dict(before)}
            done = asyncio.Event()

            async def sample() -> None:
                while not done.is_set():
                    depth = 0
                    for prio in ("latency", "batch"):
                        info = await bus.js.consumer_info(streams.REQ_STREAM, f"{streams.PLACEMENT_CONSUMER}-{prio}")
                        depth += info.num_pending + info.num_ack_pending
                    if depth >= peak["depth"]:
                        peak["depth"], peak["rss"] = depth, rss(proc)
                    await asyncio.sleep(0.1)

            async def one() -> None:
                sb = await client.create(timeout=300)
                await sb.destroy()

            sampler = asyncio.create_task(sample())
            t0 = time.monotonic()
            results = await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True)
            took = time.monotonic() - t0
            done.set()
            await sampler
            after = rss(proc)
        await bus.close()
        errors = [r for r in results if isinstance(r, BaseException)]
        mib = lambda d: ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in sorted(d.items()))  # noqa: E731
        print(f"burst of {n} real sandboxes (1 container edge, 128 slots): all ready and destroyed in {took:.1f} s "
              f"({n / took:.0f}/s), errors={len(errors)}, peak queue depth {peak['depth']}")
        print(f"  memory before: {mib(before)}; at the deepest queue: {mib(peak['rss'])}; after: {mib(after)}")
    finally:
        stop(up)


def main() -> None:
    """Parse arguments and run both sections."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--creates", type=int, default=3000, help="requests submitted at once for saturation")
    ap.add_argument("--rate", type=float, default=400.0, help="requests/s for the latency run")
    ap.add_argument("--burst", type=int, default=1000, help="real sandboxes in the burst (0: skip)")
    ap.add_argument("--no-auth", action="store_true", help="run the server without identities")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dsec-bench-") as tmp:
        asyncio.run(placement_only(Path(tmp), args.creates, args.rate, auth=not args.no_auth))
        if args.burst:
            asyncio.run(burst(Path(tmp), args.burst, auth=not args.no_auth))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
