"""N edges with the in-process no-op backend, in one process, for the placement benchmark.

Run: python -m bench.noop_edges --nats URL --count 8 --state-dir DIR   (prints `ready` when all run;
SIGINT or SIGTERM stops them)
"""
from __future__ import annotations

import argparse
import asyncio
import signal
from pathlib import Path

from bus.conn import Bus
from edge.agent import Edge
from edge.backends.noop import NoopBackend
from edge.capacity import EdgeConfig


async def run(url: str, count: int, state: Path, creds: str | None = None) -> None:
    """Start the edges, serve until a stop signal."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    bus = await Bus.connect(url, name="noop-edges", creds=creds)
    edges = []
    for i in range(count):   # room never runs out: only placement and the bus are measured
        cfg = EdgeConfig(node_id=f"noop{i}", slots=1_000_000, cpus=1_000_000, cpu_overcommit=1.0,
                         memory=1 << 60, memory_fraction=1.0, disk=1 << 60)
        edge = Edge(bus, NoopBackend(), cfg, state / f"noop{i}")
        await edge.start()
        edges.append(edge)
    print("ready", flush=True)
    await stop.wait()
    await asyncio.gather(*(e.stop() for e in edges), return_exceptions=True)
    await bus.close()


def main() -> None:
    """Parse arguments and run."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nats", required=True)
    ap.add_argument("--count", type=int, default=8)
    ap.add_argument("--state-dir", type=Path, required=True)
    ap.add_argument("--creds", default=None, help="credential file (a server with identities)")
    args = ap.parse_args()
    asyncio.run(run(args.nats, args.count, args.state_dir, args.creds))


if __name__ == "__main__":
    main()
