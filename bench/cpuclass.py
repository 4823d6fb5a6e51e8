"""Benchmark: CPU classes (issue 17) — latency inflation of a latency sandbox beside batch sandboxes.

A latency sandbox runs a probe (bench/work_probe.c, static): N times it sleeps 5 ms, then does a fixed piece
of CPU work (~1-2 ms) and times it; p50/p99 in us. Beside it, in the same run: the probe on the host alone (the
raw baseline), the sandbox alone, then with sandboxes busy-looping (`yes`) on 50% of the machine (one core's
worth) and 100% (every core), created with cpu_class="latency" (classes off: equal cpu shares, SCHED_OTHER)
and cpu_class="batch" (on: SCHED_IDLE, the smallest shares). Also the round trip of a short exec (`true`), the
same ways. Inflation = p50 with the load / p50 alone - 1. Target: <= 10% at 50% with classes on.

Run: python -m bench.cpuclass [--probes 300] [--execs 100]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import libdsec
from bench import io as io_bench
from bench.stream import dsec_up

SOURCE = Path(__file__).parent / "work_probe.c"


def build(out: Path) -> bytes:
    return io_bench.build(out, SOURCE, "-O1")     # -O1: the work loop is not folded away


async def probe(sb: libdsec.AsyncSandbox, n: int) -> tuple[int, int]:
    r = await sb.exec(["/tmp/probe", str(n)], timeout=600)
    p50, p99 = r.stdout.split()
    return int(p50), int(p99)


async def exec_loop(sb: libdsec.AsyncSandbox, n: int) -> tuple[float, float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        await sb.exec(["true"])
        times.append((time.perf_counter() - t0) * 1e6)
    times.sort()
    return statistics.median(times), times[int(len(times) * 0.99) - 1]


async def scenarios(url: str, binary: bytes, n: int, n_exec: int) -> list[tuple[str, tuple, tuple]]:
    cores = os.cpu_count() or 1
    async with libdsec.AsyncClient(url) as client:
        victim = await client.create(resources=libdsec.Resources(cpu=1))
        try:
            await victim.write_file("/tmp/probe", binary, mode=0o755)
            rows = [("latency sandbox alone", await probe(victim, n), await exec_loop(victim, n_exec))]
            for share, busy in (("50%", max(1, cores // 2)), ("100%", cores)):
                for cls in ("latency", "batch"):
                    hogs = await asyncio.gather(*(client.create(cpu_class=cls, resources=libdsec.Resources(cpu=1))
                                                  for _ in range(busy)))
                    try:
                        for hog in hogs:
                            await hog.exec("yes > /dev/null", background=True, timeout=600)
                        await asyncio.sleep(1)
                        label = f"beside {busy} busy ({share}), classes {'on' if cls == 'batch' else 'off'}"
                        rows.append((label, await probe(victim, n), await exec_loop(victim, n_exec)))
                    finally:
                        await asyncio.gather(*(h.destroy() for h in hogs), return_exceptions=True)
            return rows
        finally:
            await victim.destroy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--probes", type=int, default=300, help="timed pieces of work per measurement (default 300)")
    ap.add_argument("--execs", type=int, default=100, help="short execs per measurement (default 100)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dsec-bench-cpu-") as tmp:
        binary = build(Path(tmp) / "probe")
        raw = subprocess.run([str(Path(tmp) / "probe"), str(args.probes)], capture_output=True, text=True,
                             check=True).stdout.split()
    with dsec_up() as (url, _):
        rows = asyncio.run(scenarios(url, binary, args.probes, args.execs))
    alone = rows[0][1][0]
    alone_exec = rows[0][2][0]
    print(f"{'':<44} {'work p50 us':>11} {'p99':>7} {'inflation':>9}   {'exec p50 us':>11} {'p99':>7} {'inflation':>9}")
    print(f"{'raw: the probe on the host, alone':<44} {raw[0]:>11} {raw[1]:>7}")
    for name, (p50, p99), (e50, e99) in rows:
        print(f"{name:<44} {p50:>11} {p99:>7} {p50 / alone - 1:>+9.1%}   {e50:>11.0f} {e99:>7.0f} "
              f"{e50 / alone_exec - 1:>+9.1%}")
    print("target: inflation <= 10% at 50% with classes on (the reference system: 17.3%)")


if __name__ == "__main__":
    main()
