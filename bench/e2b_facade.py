"""Benchmark: the E2B facade beside the native SDK in the same run (issue 18).

Starts its own `dsec up`. Prints, per path, p50 and p90 of one cycle of create + run `true` + kill (the
facade's AsyncSandbox.create/commands.run/kill against client.create/sb.exec/sb.destroy, the same image,
interleaved so both see the same machine), the facade's 100 MiB file write and read in MiB/s beside a local
`cp` of the same bytes, and watch_dir's event latency (a files.write call to its create event reaching
on_event).

Run: python -m bench.e2b_facade [--cycles 40] [--mib 100]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time

from bench.stream import dsec_up

MIB = 1 << 20
IMAGE = "busybox"


def p(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


def local_cp(data: bytes) -> float:
    """Seconds to copy the bytes from one host file to another (fsync'd)."""
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        src, dst = os.path.join(tmp, "a"), os.path.join(tmp, "b")
        with open(src, "wb") as f:
            f.write(data)
            os.fsync(f.fileno())
        t = time.perf_counter()
        shutil.copyfile(src, dst)
        with open(dst, "rb+") as f:
            os.fsync(f.fileno())
        return time.perf_counter() - t


async def cycles(url: str, n: int) -> dict[str, list[float]]:
    import libdsec.e2b
    libdsec.e2b.install()
    from e2b import AsyncSandbox
    out: dict[str, list[float]] = {"native": [], "facade": []}
    async with libdsec.AsyncClient(url) as client:
        for i in range(n + 3):   # 3 warm-up rounds (layer fetch, caches, connections)
            t = time.perf_counter()
            sb = await client.create(IMAGE)
            assert (await sb.exec("true")).exit_code == 0
            await sb.destroy()
            native = time.perf_counter() - t
            t = time.perf_counter()
            sbx = await AsyncSandbox.create(IMAGE)
            assert (await sbx.commands.run("true")).exit_code == 0
            await sbx.kill()
            facade = time.perf_counter() - t
            if i >= 3:
                out["native"].append(native)
                out["facade"].append(facade)
    return out


async def files_and_watch(data: bytes) -> dict[str, list[float]]:
    from e2b import AsyncSandbox
    out: dict[str, list[float]] = {"write": [], "read": [], "event": [], "event after the call": []}
    sbx = await AsyncSandbox.create(IMAGE, timeout=600)
    try:
        for _ in range(3):
            t = time.perf_counter()
            await sbx.files.write("/data.bin", data)
            out["write"].append(time.perf_counter() - t)
            t = time.perf_counter()
            back = await sbx.files.read("/data.bin", format="bytes")
            out["read"].append(time.perf_counter() - t)
            assert back == data, "read back differs"
        await sbx.files.make_dir("/w")
        arrived: dict[str, float] = {}
        got = asyncio.Event()

        def on_event(ev) -> None:
            if ev.type.value == "create":
                arrived[ev.name] = time.perf_counter()
                got.set()
        handle = await sbx.files.watch_dir("/w", on_event, timeout=0)
        for i in range(50):
            got.clear()
            t = time.perf_counter()
            await sbx.files.write(f"/w/{i}", "x")
            returned = time.perf_counter()
            await asyncio.wait_for(got.wait(), 10)
            out["event"].append(arrived[str(i)] - t)
            out["event after the call"].append(arrived[str(i)] - returned)
        await handle.stop()
    finally:
        await sbx.kill()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=40, help="create+run+kill cycles per path (default 40)")
    ap.add_argument("--mib", type=int, default=100, help="size of the file moved (default 100)")
    args = ap.parse_args()
    data = os.urandom(args.mib * MIB)
    cp = local_cp(data)
    with dsec_up("--backend", "container") as (url, _):
        os.environ["DSEC_URL"] = url
        got = asyncio.run(cycles(url, args.cycles))

        async def rest() -> dict[str, list[float]]:
            return await files_and_watch(data)
        more = asyncio.run(rest())
    native, facade = statistics.median(got["native"]), statistics.median(got["facade"])
    for name in ("native", "facade"):
        print(f"create + run true + kill, {name:<6}: p50 {statistics.median(got[name]) * 1e3:6.1f} ms, "
              f"p90 {p(got[name], 0.9) * 1e3:6.1f} ms (of {len(got[name])})")
    print(f"facade over native: {100 * (facade / native - 1):+.1f}% at p50")
    print(f"raw: local cp of {args.mib} MiB (fsync'd): {args.mib / cp:6.0f} MiB/s")
    for name in ("write", "read"):
        s = statistics.median(more[name])
        print(f"facade files.{name:<5} {args.mib} MiB: {s:5.2f} s p50 = {args.mib / s:5.0f} MiB/s "
              f"({100 * cp / s:.0f}% of cp)")
    for name in ("event", "event after the call"):
        print(f"watch_dir {name:<21}: p50 {statistics.median(more[name]) * 1e3:6.2f} ms, "
              f"p90 {p(more[name], 0.9) * 1e3:6.2f} ms (of {len(more[name])})")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
