"""Benchmark: files in and out of a sandbox (sb.files.write / read, issue 18) — MiB/s for a big file, and the
round trip of small tree operations.

Starts its own `dsec up`. Writes and reads back --mib MiB of random bytes (checked byte for byte), three
times each, and times stat, list and mkdir+remove. Raw baselines in the same run: the same bytes written to
and read from a host file (the disk path under the sandbox's writable layer), and 8 MiB of them as one
command's output (`head -c` of the file, the exec stream; the node keeps at most 16 MiB of an exec's output),
its rate scaled to the file's size.

Run: python -m bench.files [--mib 100] [--backend container|gvisor|microvm|fullvm]
(a VM's file operations are its guest helper's, one agent exec per 512 KiB piece)
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time

import libdsec
from bench.stream import dsec_up

MIB = 1 << 20
EXEC_BYTES = 8 * MIB


def raw_host(data: bytes) -> tuple[float, float]:
    """Seconds to write (fsync'd) and read back data through a host file."""
    with tempfile.NamedTemporaryFile(dir="/var/tmp") as f:
        t = time.perf_counter()
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
        wrote = time.perf_counter() - t
        f.seek(0)
        t = time.perf_counter()
        assert f.read() == data
        return wrote, time.perf_counter() - t


async def measure(url: str, data: bytes, rounds: int, kind: str = "container") -> dict[str, list[float]]:
    res = libdsec.Resources(memory="1Gi", disk=f"{4 * len(data) // MIB + 512}Mi")
    out: dict[str, list[float]] = {"write": [], "read": [], "exec stream": [], "stat": [], "list": [], "mkdir+remove": []}
    async with libdsec.AsyncClient(url) as client:
        async with await client.create(resources=res, backend=kind, timeout=120) as sb:
            for _ in range(rounds):
                t = time.perf_counter()
                await sb.files.write("/data.bin", data)
                out["write"].append(time.perf_counter() - t)
                t = time.perf_counter()
                back = await sb.files.read("/data.bin")
                out["read"].append(time.perf_counter() - t)
                assert back == data, "read back differs"
                t = time.perf_counter()   # the node keeps at most 16 MiB of one exec's output: 8 MiB of it
                r = await sb.exec(["head", "-c", str(EXEC_BYTES), "/data.bin"], timeout=300)
                out["exec stream"].append((time.perf_counter() - t) * len(data) / EXEC_BYTES)   # scaled to the file
                assert r.stdout == data[:EXEC_BYTES] and not r.truncated, "exec output differs"
            for _ in range(50):
                t = time.perf_counter()
                await sb.files.get_info("/data.bin")
                out["stat"].append(time.perf_counter() - t)
                t = time.perf_counter()
                await sb.files.list("/etc")
                out["list"].append(time.perf_counter() - t)
                t = time.perf_counter()
                await sb.files.make_dir("/d/e")
                await sb.files.remove("/d")
                out["mkdir+remove"].append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=100, help="size of the big file (default 100)")
    ap.add_argument("--rounds", type=int, default=3, help="writes and reads of it (default 3)")
    ap.add_argument("--backend", default="container", choices=("container", "gvisor", "microvm", "fullvm"),
                    help="the sandbox kind (default container)")
    args = ap.parse_args()
    data = os.urandom(args.mib * MIB)
    wrote, read = raw_host(data)
    with dsec_up("--backend", args.backend, "--no-mirrors", "--no-aether") as (url, _):
        got = asyncio.run(measure(url, data, args.rounds, args.backend))
    print(f"backend {args.backend}")
    mib = args.mib
    print(f"raw: host file write+fsync {mib / wrote:7.0f} MiB/s, read {mib / read:7.0f} MiB/s")
    for name in ("write", "read", "exec stream"):
        p50 = statistics.median(got[name])
        label = "raw: an exec stream" if name == "exec stream" else f"sb.files {name}"
        print(f"{label:<22} {mib} MiB: {p50:6.2f} s p50 = {mib / p50:6.0f} MiB/s (of {len(got[name])})")
    for name in ("stat", "list", "mkdir+remove"):
        print(f"sb.files {name:<13} p50 {statistics.median(got[name]) * 1e3:6.2f} ms")


if __name__ == "__main__":
    main()
