"""Benchmark: environments — create latency with cached layers and with a layer fetch, snapshot of a
100 MiB writable layer, fork of 8 from it — beside the raw `unshare` launch measured in the same run.

Run: python -m bench.environments [--creates N] [--snapshot-mib M] [--fork N] [--nats URL]
     (starts its own `dsec up` on free ports with its own state dir and node id, like bench.stream)
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import libdsec
from bench.cycle import raw_baseline
from bench.stream import dsec_up
from cli.demo import percentile

DSEC = str(Path(sys.executable).parent / "dsec")


def ms(values: list[float]) -> str:
    return f"p50 {percentile(values, 50):8.2f} ms  p99 {percentile(values, 99):8.2f} ms"


async def timed(coro) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = await coro
    return (time.perf_counter() - t0) * 1000, out


async def creates(client: libdsec.AsyncClient, n: int, **kwargs) -> list[float]:
    """Sequential create -> ready latencies (each destroyed after)."""
    out = []
    for _ in range(n):
        t, sb = await timed(client.create(**kwargs))
        out.append(t)
        await sb.destroy()
    return out


async def init_started(sb: libdsec.AsyncSandbox) -> float:
    """When the sandbox's init started, in seconds since boot (CLOCK_BOOTTIME, 10 ms resolution)."""
    stat = (await sb.exec(["cat", "/proc/1/stat"])).stdout.decode()
    return int(stat.rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")


async def warm_claims(client: libdsec.AsyncClient, n: int) -> tuple[list[float], int]:
    """Sequential creates that each find a warm sandbox ready (the pool refills between them, as it does
    between the creates of a rollout's steps); (latencies, how many were claimed warm)."""
    await client.set_warm_pool("bench", min=2, max=4)
    try:
        out, hits = [], 0
        for i in range(n + 5):
            for _ in range(200):   # refilled in the background after each claim
                if (await client.warm_pools())[0].total >= 1:
                    break
                await asyncio.sleep(0.01)
            sent = time.clock_gettime(time.CLOCK_BOOTTIME)
            t, sb = await timed(client.create())
            out.append(t)
            hits += i >= 5 and await init_started(sb) < sent - 0.02   # its init is older than the request: warm
            await sb.destroy()
        return out[5:], hits
    finally:
        await client.delete_warm_pool("bench")


def build_layer(url: str, name: str, i: int, tmp: Path) -> None:
    """A new workspace layer version (distinct bytes: the node has to fetch it)."""
    root = tmp / f"ws{i}"
    (root / "work").mkdir(parents=True)
    (root / "work" / "data").write_bytes(i.to_bytes(4, "big") * (256 << 10))   # 1 MiB
    subprocess.run([DSEC, "image", "build", "--nats", url, name, "--kind", "workspace", "--from-dir", str(root)],
                   check=True, capture_output=True)


async def measure(url: str, args: argparse.Namespace) -> None:
    raw = raw_baseline(50)
    print(f"raw unshare launch                     {ms(raw)}")
    async with libdsec.AsyncClient(url) as client:
        await creates(client, 5)                                   # warm-up: layers cached, mounts idle
        cached = await creates(client, args.creates)
        print(f"create, layers cached                  {ms(cached)}  ({percentile(cached, 50) / percentile(raw, 50):.1f}x raw)")
        fetched = []
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(max(3, args.creates // 5)):
                await asyncio.to_thread(build_layer, url, "benchws", i, Path(tmp))
                t, sb = await timed(client.create(workspace="benchws"))
                fetched.append(t)
                await sb.destroy()
        print(f"create, with a 1 MiB layer fetch       {ms(fetched)}  ({percentile(fetched, 50) / percentile(raw, 50):.1f}x raw)")
        claimed, hits = await warm_claims(client, args.creates)
        print(f"create, warm-pool claim                {ms(claimed)}  ({percentile(claimed, 50) / percentile(raw, 50):.1f}x raw,"
              f" {hits}/{len(claimed)} claimed warm)")
        warm_target = percentile(claimed, 50)
        sb = await client.create(resources=libdsec.Resources(disk=f"{args.snapshot_mib * 2}Mi"))
        try:
            await sb.exec(f"head -c {args.snapshot_mib << 20} /dev/urandom > /big", timeout=120)
            t_snap, snap = await timed(sb.snapshot(tag="bench"))
            print(f"snapshot of a {args.snapshot_mib} MiB writable layer     {t_snap:8.1f} ms  (layer {snap.size >> 20} MiB)")
            t_fork, forks = await timed(client.fork(snap, n=args.fork))
            print(f"fork of {args.fork} from it                        {t_fork:8.1f} ms  "
                  f"(its layer kept on this node by the snapshot: no fetch)")
            await asyncio.gather(*(f.destroy() for f in forks))
            t_fork2, forks = await timed(client.fork(snap, n=args.fork))
            print(f"fork of {args.fork} again                          {t_fork2:8.1f} ms")
            t_get, _ = await timed(client._need_bus().obj_get("dsec-layers", snap.layers[-1].digest))
            print(f"fetch of its {snap.size >> 20} MiB layer from the store     {t_get:8.1f} ms  (what another node pays once)")
            await asyncio.gather(*(f.destroy() for f in forks))
        finally:
            await sb.destroy()
        await client.delete_snapshot(snap)
        for target, value, label in ((5, warm_target, "warm-pool create p50 <= 5 ms"),
                                     (2000, t_snap, "snapshot <= 2 s"), (1000, t_fork, "fork of 8 <= 1 s")):
            print(f"target {'met    ' if value <= target else 'NOT met'}  {label}: {value:.1f} ms")
        print(f"(mean create cached {statistics.mean(cached):.2f} ms over {len(cached)})")


def main(args: argparse.Namespace) -> int:
    if args.nats:
        asyncio.run(measure(args.nats, args))
    else:
        with dsec_up() as (url, note_procs):
            note_procs()
            asyncio.run(measure(url, args))
            note_procs()
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[2:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--creates", type=int, default=30, help="sequential creates per figure (default 30)")
    ap.add_argument("--snapshot-mib", type=int, default=100, help="MiB written before the snapshot (default 100)")
    ap.add_argument("--fork", type=int, default=8, help="sandboxes per fork (default 8)")
    ap.add_argument("--nats", default=None, metavar="URL", help="measure an already running `dsec up` at this URL")
    sys.exit(main(ap.parse_args()))
