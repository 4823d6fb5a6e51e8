"""Benchmark: lists and quotas of a tenant whose bucket holds many ended sandboxes, against the raw read of
all its records (what every list of its running sandboxes, quota and `dsec ls` cost before the live index).

Run: python -m bench.listing [--records N] [--live M]   (starts its own `dsec up` on free ports)
Puts N destroyed records of tenant `default` into KV dsec-sandboxes (as two days of a busy tenant leave
them), creates M sandboxes, then prints p50/p99 of list() (running), quota(), list(all_states=True), and
the raw baseline: one ordered read of every record of the tenant, measured in the same run.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path

import libdsec
from bus import streams, subjects
from bus.conn import Bus
from bus.records import SandboxRecord, sandbox_decoder
from bench.cycle import dsec_up
from cli.demo import percentile


async def timed(n: int, make) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await make()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def line(name: str, values: list[float], raw: float) -> str:
    p50 = statistics.median(values)
    return f"{name:<28} p50 {p50:9.1f} ms  p99 {percentile(values, 99):9.1f} ms  ({p50 / raw:6.3f} x raw)"


async def measure(url: str, records: int, live: int, runs: int) -> None:
    admin = await Bus.connect(url, creds=str(Path(os.environ["DSEC_STATE_DIR"]) / "creds" / "admin.creds"))
    try:
        now = time.time()
        for start in range(0, records, 1000):
            await asyncio.gather(*(admin.kv_put(streams.SANDBOXES_KV, subjects.record_key("default", f"sb-ended-{i:07d}"),
                                                SandboxRecord(sandbox_id=f"sb-ended-{i:07d}", tenant="default",
                                                              state="destroyed", created_at=now - 86400 + i * 1e-3))
                                   for i in range(start, min(records, start + 1000))))
        async with libdsec.AsyncClient(url) as client:
            sbs = [await client.create() for _ in range(live)]
            try:
                raw = await timed(runs, lambda: admin.kv_values(streams.SANDBOXES_KV, sandbox_decoder,
                                                                prefix=subjects.record_prefix("default")))
                base = statistics.median(raw)
                listed = await timed(runs, client.list)
                quota = await timed(runs, client.quota)
                every = await timed(max(1, runs // 5), lambda: client.list(all_states=True))
                assert len(await client.list()) == live and (await client.quota()).sandboxes == live
                print(f"{records} ended records and {live} running sandboxes of one tenant")
                print(line("raw read of every record", raw, base))
                print(line("list() (running)", listed, base))
                print(line("quota()", quota, base))
                print(line("list(all_states=True)", every, base))
            finally:
                for sb in sbs:
                    await sb.destroy()
    finally:
        await admin.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=20000, help="ended records of the tenant (default 20000)")
    ap.add_argument("--live", type=int, default=10, help="running sandboxes of the tenant (default 10)")
    ap.add_argument("--runs", type=int, default=20, help="timed runs of each read (default 20)")
    args = ap.parse_args()
    with dsec_up() as url:
        asyncio.run(measure(url, args.records, args.live, args.runs))


if __name__ == "__main__":
    main()
