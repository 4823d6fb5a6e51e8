"""`dsec top`: a live terminal view of nodes, queues and placement."""
from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import dataclass

import click

from bus import streams, subjects
from bus.conn import Bus
from bus.errors import BusError, PermissionDenied
from bus.records import engine_decoder
from cli.admin import node_rows, read_nodes
from cli.main import connect, main, nats_option, run_async


@dataclass
class Frame:
    """One refresh worth of figures."""

    at: float
    placed: int
    bursted: int
    lines: list[str]


async def _queues(bus: Bus, pools: set[str]) -> list[tuple[str, int, int]]:
    """(lane, waiting unpulled, held unacked) of the create consumers."""
    out = []
    lanes = [(streams.REQ_STREAM, f"{streams.PLACEMENT_CONSUMER}-{p}", f"placement {p}") for p in subjects.PRIORITIES]
    lanes += [(streams.NODE_STREAM, streams.pool_create_consumer(p)[1].durable_name, f"pool {p}") for p in sorted(pools)]
    for stream, durable, label in lanes:
        try:
            info = await bus.js.consumer_info(stream, durable)
            out.append((label, info.num_pending, info.num_ack_pending))
        except Exception:
            continue   # not created yet
    return out


async def frame(bus: Bus, prev: Frame | None) -> Frame:
    """Read everything once and render it."""
    nodes = await read_nodes(bus)
    engines = []
    for _, raw in await bus.kv_items(streams.ENGINES_KV):
        try:
            engines.append(engine_decoder.decode(raw))
        except Exception:
            continue
    now = time.time()
    placed = sum(e.placed for e in engines)
    bursted = sum(e.bursted for e in engines)
    rate = (placed - prev.placed) / max(now - prev.at, 1e-6) if prev and placed >= prev.placed else 0.0
    util = max((e.utilization for e in engines), default=0.0)
    threshold = max((e.threshold for e in engines), default=0.8)
    lines = [f"dsec top  {time.strftime('%H:%M:%S')}  nodes={len(nodes)}  engines={len(engines)}  "
             f"local utilization={util:.0%} (burst past {threshold:.0%})", ""]
    lines += node_rows(nodes)
    lines.append("")
    queues = await _queues(bus, {n.pool for n in nodes if n.pool != "local"})
    lines.append("queue depth: " + ("  ".join(f"{label}={w} waiting+{h} held" for label, w, h in queues) or "-"))
    lines.append(f"creates/s={rate:.1f}  placed={placed}  burst share={bursted / placed if placed else 0:.1%}  "
                 f"placement latency p50={max((e.latency_p50 for e in engines), default=0) * 1e3:.1f} ms "
                 f"p99={max((e.latency_p99 for e in engines), default=0) * 1e3:.1f} ms")
    for e in sorted(engines, key=lambda e: e.engine):
        lines.append(f"  engine {e.engine}: placed={e.placed} bursted={e.bursted} rejected={e.rejected} "
                     f"waiting={e.queued} cas-conflicts={e.conflicts}")
    return Frame(now, placed, bursted, lines)


@main.command()
@nats_option
@click.option("--interval", default=1.0, show_default=True, type=click.FloatRange(min=0.1),
              help="Seconds between refreshes (at least 0.1).")
@click.option("--once", is_flag=True, help="Print one frame and exit (for scripts).")
@run_async
async def top(nats_url: str, interval: float, once: bool) -> None:
    """Live view: nodes (pool, used/capacity per dimension, heartbeat age), queue depth, creates/s,
    placement latency p50/p99 and burst share. Ctrl-C quits."""
    bus = await connect(nats_url, "dsec-top", "ops")
    prev = None
    loop, me, quit_ = asyncio.get_running_loop(), asyncio.current_task(), []
    loop.add_signal_handler(signal.SIGINT, lambda: (quit_.append(True), me.cancel()))   # Ctrl-C: quit, exit 0
    try:
        while True:
            try:
                cur = await frame(bus, prev)
            except BusError as exc:
                # --once, or a credential that may not read the nodes: no later try can do better
                if once or isinstance(exc, PermissionDenied) or "not enabled for account" in str(exc):
                    raise
                click.echo(f"dsec: waiting for NATS: {exc}", err=True)
                await asyncio.sleep(interval)
                continue
            if once:
                click.echo("\n".join(cur.lines))
                return
            click.echo("\x1b[H\x1b[2J" + "\n".join(cur.lines), nl=True)
            prev = cur
            await asyncio.sleep(interval)
    except asyncio.CancelledError:   # Ctrl-C, the way to quit: exit 0, quietly (it said "interrupted", 130);
        if not quit_:                # SIGTERM, SIGHUP: 143, 129 as for any command
            raise
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        await bus.close()
