"""Benchmark: density — how many idle sandboxes one node holds, and the host memory each costs.

Starts its own `dsec up` sized for it (--slots N --cpu-overcommit 1 --memory-fraction 1 --backend container
--capacity slots=N and cpu, memory and disk booked for N of them: the writable-layer pool image is
sparse), creates N sandboxes of
cpu=0.1, memory=64Mi in batches, lets the host settle, and reports
the drop of MemAvailable divided by the count (beside the same figure for N bare `unshare` + `sleep`
processes, the raw baseline, measured in the same run). Then destroys them all.

Run: python -m bench.density [--sandboxes 10000] [--batch 100] [--raw 500]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import time
from pathlib import Path

import libdsec
from bench.stream import dsec_up

MIB = 1 << 20


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


BREAKDOWN = ("Slab", "Percpu", "PageTables", "KernelStack", "AnonPages", "Shmem", "Cached")


def meminfo() -> dict[str, int]:
    """/proc/meminfo's fields, in bytes."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, value = line.split(":", 1)
            out[name] = int(value.split()[0]) * 1024
    return out


def shrinker_map_bytes(probes: int = 50) -> float:
    """Bytes of shrinker map a new memory cgroup gets on this host now: the kmalloc-1k objects that `probes`
    fresh memcgs add, per memcg. The kernel sizes it by the most superblocks ever alive at once since boot
    (64 per 1 KiB unit), so it says what this host's history costs every sandbox (edge/backends/nodemounts.py)."""
    def objects() -> int:
        with open("/proc/slabinfo") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("kmalloc-1k "))
    base = Path("/sys/fs/cgroup/memory") / f"dsec-bench-probe-{os.getpid()}"
    base.mkdir()
    try:
        before = objects()
        for i in range(probes):
            (base / str(i)).mkdir()
        grown = objects() - before
    finally:
        for i in range(probes):
            with contextlib.suppress(OSError):
                (base / str(i)).rmdir()
        base.rmdir()
    return grown * 1024 / probes


def settled() -> int:
    """MemAvailable after the page cache and slabs settle a little (median of 5 reads, 0.2 s apart)."""
    reads = []
    for _ in range(5):
        time.sleep(0.2)
        reads.append(mem_available())
    return sorted(reads)[2]


def raw_baseline(n: int) -> float:
    """Host bytes per bare namespaced process (`unshare -fpmnui sleep`), the floor of any sandbox."""
    before = settled()
    procs = [subprocess.Popen(["unshare", "-fpmnui", "--mount-proc", "sleep", "600"]) for _ in range(n)]
    time.sleep(1)
    after = settled()
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()
    return (before - after) / n


Mark = tuple[int, float, dict[str, float]]   # (held, monotonic time, cpu_clock() then)


def _task_seconds(pid: int | str) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime + stime


def _comm(pid: int | str) -> str:
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


def cpu_clock(kswapd: list[int]) -> dict[str, float]:
    """CPU seconds so far: "busy" (all CPUs, /proc/stat without idle and iowait), "pid 1" (the host's init:
    on this machine not systemd but an agent whose work grows with the processes on the host, even idle, so its
    share grows with the sandboxes held, one process each) and "kswapd" (its passes walk every memory cgroup)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return {"busy": (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK"), "pid 1": _task_seconds(1),
            "kswapd": sum(_task_seconds(pid) for pid in kswapd)}


def kswapd_pids() -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        with contextlib.suppress(OSError):   # (a process that exits meanwhile)
            if pid.isdigit() and _comm(pid).startswith("kswapd"):
                found.append(int(pid))
    return found


def window(marks: list[Mark], at: int, width: int = 500) -> tuple[Mark, Mark] | None:
    """The first and last mark of the batches from the one that passed `at` held, about `width` creates."""
    start = next((i for i, mark in enumerate(marks) if mark[0] > at), None)
    if start is None or start == 0:
        return None
    end = next((i for i in range(start, len(marks)) if marks[i][0] - marks[start - 1][0] >= width), len(marks) - 1)
    return marks[start - 1], marks[end]


def rate_at(marks: list[Mark], at: int, width: int = 500) -> float:
    """Creates per second over the batches from the one that passed `at` held, about `width` creates."""
    span = window(marks, at, width)
    if span is None:
        return 0.0
    first, last = span
    return (last[0] - first[0]) / max(1e-9, last[1] - first[1])


def cpu_per_create(marks: list[Mark], at: int, width: int = 500) -> dict[str, float]:
    """CPU milliseconds per create over rate_at's window: all of it, and pid 1's and kswapd's part of it."""
    span = window(marks, at, width)
    if span is None:
        return {}
    first, last = span
    made = max(1, last[0] - first[0])
    return {k: (last[2][k] - first[2][k]) * 1000 / made for k in first[2]}


async def fill(url: str, n: int, batch: int, marks: list[Mark],
               parts: dict[str, float]) -> tuple[int, float, float]:
    """Create n idle sandboxes; returns (created, bytes per sandbox, seconds); marks gets (held, time, CPU
    clocks) after every batch (the create rate and its CPU as the node fills), parts the growth of each
    BREAKDOWN field per sandbox."""
    res = libdsec.Resources(cpu=0.1, memory="64Mi")
    async with libdsec.AsyncClient(url) as client:
        before = settled()
        fields = meminfo()
        t0 = time.monotonic()
        made: list[libdsec.AsyncSandbox] = []
        kswapd = kswapd_pids()
        marks.append((0, t0, cpu_clock(kswapd)))
        try:
            while len(made) < n:
                got = await asyncio.gather(*(client.create(resources=res) for _ in range(min(batch, n - len(made)))),
                                           return_exceptions=True)
                made += [g for g in got if isinstance(g, libdsec.AsyncSandbox)]
                marks.append((len(made), time.monotonic(), cpu_clock(kswapd)))
                errors = [g for g in got if not isinstance(g, libdsec.AsyncSandbox)]
                if errors:
                    print(f"  stopped at {len(made)}: {type(errors[0]).__name__}: {errors[0]}", flush=True)
                    break
            took = time.monotonic() - t0
            await asyncio.sleep(2)
            after = settled()
            grown = meminfo()
            parts.update({k: (grown[k] - fields[k]) / max(1, len(made)) for k in BREAKDOWN if k in grown})
            parts["shrinker map"] = shrinker_map_bytes()   # of a memcg made now, with them all held
            return len(made), (before - after) / max(1, len(made)), took
        finally:
            for i in range(0, len(made), batch):
                await asyncio.gather(*(sb.destroy() for sb in made[i:i + batch]), return_exceptions=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sandboxes", type=int, default=10000, help="idle sandboxes to create (default 10000)")
    ap.add_argument("--batch", type=int, default=100, help="creates in flight at once (default 100)")
    ap.add_argument("--raw", type=int, default=500, help="bare processes for the raw baseline (default 500)")
    args = ap.parse_args()
    raw = raw_baseline(args.raw)
    n = args.sandboxes
    # Booked memory for every sandbox's 64 MiB and the 2 MiB of overhead each container books, all of it
    # schedulable (--memory-fraction 1; with a fixed 400Gi the run stopped at 6,206 of 10,000: "no node has
    # room"). Container only: the density of container sandboxes, with no fncall workers beside them.
    with dsec_up("--slots", str(n), "--cpu-overcommit", "1", "--memory-fraction", "1", "--backend", "container",
                 "--capacity", f"slots={n},cpu={n // 10 + 10},memory={n * 70}Mi,disk={n * 300}Mi") as (url, _):
        marks: list[Mark] = []
        parts: dict[str, float] = {}
        made, per, took = asyncio.run(fill(url, n, args.batch, marks, parts))
    print(f"raw baseline: {raw / MIB:.2f} MiB per bare namespaced process ({args.raw} of them)")
    print(f"density: {made} idle sandboxes (of {n}) in {took:.1f} s, {per / MIB:.2f} MiB of host memory each "
          f"(MemAvailable drop / count; {per / max(raw, 1):.1f}x raw)")
    shrinker = parts.pop("shrinker map")
    print("  of which, per sandbox (meminfo growth / count): "
          + ", ".join(f"{k} {v / 1024:.0f} KiB" for k, v in parts.items()))
    print(f"  shrinker map of a memory cgroup made now: {shrinker / 1024:.0f} KiB (in Slab; sized by the most "
          f"superblocks ever alive at once on this host since boot, about {shrinker / 16:,.0f})")
    empty = rate_at(marks, 0)
    init = _comm(1)
    for at in (0, n // 2, n * 9 // 10):
        r = rate_at(marks, at)
        cpu = cpu_per_create(marks, at)
        print(f"  create rate with {at:>6} held: {r:7.1f}/s ({r / max(empty, 1e-9):.0%} of the empty node's); "
              f"CPU per create {cpu.get('busy', 0):.1f} ms, of it pid 1 ({init}) {cpu.get('pid 1', 0):.1f} ms, "
              f"kswapd {cpu.get('kswapd', 0):.1f} ms")
    print("target: >= 10,000 held at <= 0.7 MiB each; the rate at 9,000 held within 20% of the empty node's")


if __name__ == "__main__":
    main()
