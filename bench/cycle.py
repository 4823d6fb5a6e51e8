"""Benchmark: create -> exec `true` -> destroy through the whole path, against a raw `unshare` baseline.

Run: python -m bench.cycle [--cycles N]   (starts its own `dsec up` on free ports, as a separate process,
     or uses --nats URL of one already running)
Prints p50/p99 of create (request sent -> ready), exec round trip, destroy, cycles/s sequential and with
8 and 32 in flight, and each figure's ratio to the raw baseline measured in the same run.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import libdsec
from bus.server import die_with_parent, free_port
from cli.demo import percentile

RAW = ["unshare", "--fork", "--pid", "--mount", "--net", "--uts", "--ipc", "--mount-proc", "/bin/true"]


def raw_baseline(n: int) -> list[float]:
    """Milliseconds per raw five-namespace launch."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(RAW, check=True)
        out.append((time.perf_counter() - t0) * 1000)
    return out


async def cycle(client: libdsec.AsyncClient, figures: dict) -> None:
    """One create -> exec true -> destroy, timing each step."""
    t0 = time.perf_counter()
    sb = await client.create(image="busybox")
    t1 = time.perf_counter()
    r = await sb.exec(["true"])
    t2 = time.perf_counter()
    await sb.destroy()
    t3 = time.perf_counter()
    assert r.exit_code == 0
    figures["create"].append((t1 - t0) * 1000)
    figures["exec"].append((t2 - t1) * 1000)
    figures["destroy"].append((t3 - t2) * 1000)


async def run_level(client: libdsec.AsyncClient, cycles: int, in_flight: int) -> tuple[dict, float]:
    """`cycles` cycles with `in_flight` at once; returns figures and cycles/s."""
    figures: dict = {"create": [], "exec": [], "destroy": []}
    sem = asyncio.Semaphore(in_flight)

    async def one() -> None:
        async with sem:
            await cycle(client, figures)

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(cycles)))
    return figures, cycles / (time.perf_counter() - t0)


def line(name: str, values: list[float], raw_p50: float) -> str:
    """One figure line."""
    p50, p99 = statistics.median(values), percentile(values, 99)
    return f"  {name:<8} p50 {p50:7.2f} ms  p99 {p99:7.2f} ms  ({p50 / raw_p50:4.1f}x raw p50)"


@contextlib.contextmanager
def dsec_up(*extra: str):
    """`dsec up` (the embedded default: identities on) in its own process group on free ports; yields its URL.
    The SDK finds the default tenant's credential under its state dir."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="dsec-bench-") as tmp:
        os.environ["DSEC_STATE_DIR"] = tmp
        proc = subprocess.Popen([str(Path(sys.executable).parent / "dsec"), "up", "--state-dir", tmp, "--port",
                                 str(port), "--metrics-port", str(free_port()), "--node-id", "bench", *extra],
                                stdout=subprocess.PIPE, text=True, start_new_session=True,
                                preexec_fn=die_with_parent)   # a killed bench leaves no `dsec up` behind
        try:
            line = proc.stdout.readline().strip()
            if not line.startswith("dsec: ready "):
                raise SystemExit(f"dsec up did not start: {line!r}")
            yield line.split()[-1]
        finally:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(30)


async def measure(url: str, cycles: int, raw_p50: float) -> None:
    """Warm up, then each level."""
    async with libdsec.AsyncClient(url) as client:
        await run_level(client, 10, 1)   # warm-up: layer fetch, mounts, caches
        for in_flight in (1, 8, 32):
            n = cycles if in_flight == 1 else max(cycles, 4 * in_flight)
            figures, rate = await run_level(client, n, in_flight)
            label = "sequential" if in_flight == 1 else f"{in_flight} in flight"
            print(f"dsec cycle, {label} ({n} cycles): {rate:.1f} cycles/s "
                  f"({rate / (1000 / raw_p50):.2f}x raw launches/s)")
            for name in ("create", "exec", "destroy"):
                print(line(name, figures[name], raw_p50))


def main(cycles: int, raw_n: int, url: str | None, auth: bool = True) -> None:
    """Raw baseline, then the dsec figures."""
    raw = raw_baseline(raw_n)
    raw_p50 = statistics.median(raw)
    print(f"raw baseline: {' '.join(RAW)}")
    print(f"  raw      p50 {raw_p50:7.2f} ms  p99 {percentile(raw, 99):7.2f} ms  ({1000 / statistics.mean(raw):.0f}/s)")
    if url:
        asyncio.run(measure(url, cycles, raw_p50))
        return
    print(f"dsec up: identities {'on (the default tenant credential)' if auth else 'off (--no-auth)'}")
    with dsec_up(*([] if auth else ["--no-auth"])) as started:
        asyncio.run(measure(started, cycles, raw_p50))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=100, help="cycles per level (default 100)")
    ap.add_argument("--raw", type=int, default=100, help="raw baseline launches (default 100)")
    ap.add_argument("--nats", default=None, help="measure an already running `dsec up` at this URL")
    ap.add_argument("--no-auth", action="store_true", help="start `dsec up --no-auth` (no identities)")
    args = ap.parse_args()
    main(args.cycles, args.raw, args.nats, auth=not args.no_auth)
