"""`dsec demo`: the main job. A demo rollout on the embedded default, with a progress bar and a summary."""
from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

import click

import libdsec
from bus.server import PortInUse, check_port_free, free_port
from cli.main import main, run_async
from cli.up import state_dir_option

SCRIPT = b"""n=0
for w in $(cat /tmp/words.txt); do n=$((n+1)); done
echo "words=$n"
echo "host=$(hostname)"
echo "warn: this line goes to stderr" >&2
"""


def percentile(values: list[float], q: float) -> float:
    """q-th percentile (0-100) by nearest rank; 0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


async def one_episode(client: libdsec.AsyncClient, i: int, stats: dict, tick) -> None:
    """Create a sandbox, write a file, run a small script streaming its output, read a result, destroy."""
    t0 = time.perf_counter()
    try:
        async with await client.create(image="busybox", labels={"job": "demo", "episode": str(i)}) as sb:
            stats["create_ms"].append((time.perf_counter() - t0) * 1000)
            await sb.write_file("/tmp/words.txt", " ".join(f"w{j}" for j in range(i + 1)).encode())
            await sb.write_file("/tmp/run.sh", SCRIPT)
            lines = []
            async for ev in sb.stream(["sh", "/tmp/run.sh"], timeout=30):
                if isinstance(ev, libdsec.Output):
                    lines.append(ev.data)
                    if i == 0:   # one episode's stream, line by line as it arrived, for the summary
                        stats["sample"].append(f"{ev.stream}: {ev.data.decode(errors='replace').rstrip()}")
                elif ev.exit_code != 0:
                    raise RuntimeError(f"script exited {ev.exit_code}")
            stats["lines"] += len(lines)
            r = await sb.exec(f"echo result-{i} > /tmp/out && cat /tmp/out", timeout=10)
            if r.stdout.strip() != f"result-{i}".encode() or f"words={i + 1}".encode() + b"\n" not in lines:
                raise RuntimeError(f"episode {i}: unexpected output {r.stdout!r} {lines!r}")
            stats["commands"] += 4   # write, write, script, exec
    except (libdsec.DsecError, RuntimeError) as exc:
        stats["failures"].append(f"episode {i}: {exc}")
    finally:
        tick()   # one step per finished episode


async def rollout(url: str, n: int, creds: str | None = None) -> dict:
    """Run n episodes in parallel, with a progress bar on stderr."""
    stats: dict = {"create_ms": [], "commands": 0, "lines": 0, "failures": [], "sample": []}
    with click.progressbar(length=n, label=f"demo rollout: {n} sandboxes in parallel",
                           file=click.get_text_stream("stderr"), show_pos=True) as bar:
        async with libdsec.AsyncClient(url, creds=creds) as client:
            t0 = time.perf_counter()
            await asyncio.gather(*(one_episode(client, i, stats, lambda: bar.update(1)) for i in range(n)))
            stats["total_s"] = time.perf_counter() - t0
    return stats


def summary(n: int, stats: dict) -> str:
    """The one-screen summary."""
    c = stats["create_ms"]
    lines = [
        "dsec demo: summary",
        f"  sandboxes      {n} ({len(c)} created)",
        f"  commands       {stats['commands']} ({stats['lines']} output lines streamed)",
        f"  failures       {len(stats['failures'])}",
        f"  create p50     {statistics.median(c) if c else 0:.1f} ms",
        f"  create p99     {percentile(c, 99):.1f} ms",
        f"  total time     {stats['total_s']:.2f} s",
    ]
    lines += ["  streamed by episode 0:"] + [f"    {line}" for line in stats["sample"]]
    lines += [f"  ! {f}" for f in stats["failures"][:10]]
    return "\n".join(lines)


@main.command()
@state_dir_option
@click.option("--sandboxes", "-n", default=32, show_default=True, type=click.IntRange(1, 10_000),
              help="Sandboxes created in parallel.")
@click.option("--port", default=4222, show_default=True, type=click.IntRange(1, 65535),
              help="Embedded NATS port (a free one if taken).")
@run_async
async def demo(state_dir: Path, sandboxes: int, port: int) -> None:
    """The main job: start everything locally, run a rollout of N sandboxes in parallel (write a file, run a
    script, stream its output, read a result), destroy them, print a summary, stop everything."""
    from cli.stack import Stack
    try:
        check_port_free("127.0.0.1", port, "NATS")
    except PortInUse:
        port = free_port()
    stack = Stack(Path(state_dir) / "demo", port=port, metrics_port=None, auth=True)
    click.echo(f"dsec demo: starting NATS, placement and an edge on {stack.url}", err=True)
    await stack.start()
    try:
        stats = await rollout(stack.url, sandboxes, creds=stack.tenant_creds())
    finally:
        await stack.stop()
    click.echo(summary(sandboxes, stats))
    if stats["failures"]:
        raise SystemExit(1)
