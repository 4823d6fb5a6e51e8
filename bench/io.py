"""Benchmark: I/O isolation — a neighbour's fsync latency while another sandbox floods the disk.

A victim sandbox writes 4 KiB and fdatasyncs it, 200 times (bench/fsync_probe.c, static), and reports
p50/p99; beside it, in the same run: the same probe on the host's own filesystem (the raw baseline), the
victim alone, and the victim while a second sandbox runs (a) a buffered `dd` flood, (b) a direct
(O_DIRECT) `dd` flood, which blkio throttles to 64 MiB/s per sandbox, (c) a `sync` loop (a no-op inside).

Run: python -m bench.io [--probes 200] [--flood-mib 400]
"""
from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import tempfile
from pathlib import Path

import libdsec
from bench.stream import dsec_up

SOURCE = Path(__file__).parent / "fsync_probe.c"


def build(out: Path, source: Path = SOURCE, opt: str = "-O2") -> bytes:
    """A static probe built from source with the host's compiler (any image runs it); its bytes."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("this benchmark needs a C compiler (make setup installs gcc)")
    subprocess.run([cc, opt, "-s", "-static", "-o", str(out), str(source)], check=True)
    return out.read_bytes()


async def probe(sb: libdsec.AsyncSandbox, n: int) -> tuple[int, int]:
    r = await sb.exec(["/tmp/probe", str(n), "/tmp/probe.dat"], timeout=300)
    p50, p99 = r.stdout.split()
    return int(p50), int(p99)


async def scenarios(url: str, binary: bytes, n: int, flood_mib: int) -> list[tuple[str, tuple[int, int]]]:
    res = libdsec.Resources(disk=f"{flood_mib + 128}Mi")
    async with libdsec.AsyncClient(url) as client:
        victim = await client.create(resources=libdsec.Resources(disk="64Mi"))
        noisy = await client.create(resources=res)
        try:
            await victim.write_file("/tmp/probe", binary, mode=0o755)
            out = [("victim alone", await probe(victim, n))]
            floods = [("buffered dd flood", f"while :; do dd if=/dev/zero of=/tmp/flood bs=1M count={flood_mib} "
                                             f"2>/dev/null; rm -f /tmp/flood; done"),
                      ("direct dd flood", f"while :; do dd if=/dev/zero of=/tmp/flood bs=1M count={flood_mib} "
                                          f"oflag=direct 2>/dev/null; rm -f /tmp/flood; done"),
                      ("sync loop", "while :; do sync; done")]
            for name, cmd in floods:
                handle = await noisy.exec(cmd, background=True, timeout=600)
                await asyncio.sleep(1)   # let it get going
                out.append((f"victim beside a {name}", await probe(victim, n)))
                await handle.kill()
                await asyncio.sleep(0.5)
            return out
        finally:
            await asyncio.gather(victim.destroy(), noisy.destroy(), return_exceptions=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--probes", type=int, default=200, help="fdatasyncs per measurement (default 200)")
    ap.add_argument("--flood-mib", type=int, default=400, help="MiB each flood pass writes (default 400)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dsec-bench-io-") as tmp:
        binary = build(Path(tmp) / "probe")
        raw = subprocess.run([str(Path(tmp) / "probe"), str(args.probes), str(Path(tmp) / "probe.dat")],
                             capture_output=True, text=True, check=True).stdout.split()
    with dsec_up() as (url, _):
        rows = asyncio.run(scenarios(url, binary, args.probes, args.flood_mib))
    print(f"{'fdatasync of 4 KiB':<40} {'p50 us':>8} {'p99 us':>8}")
    print(f"{'raw: the host filesystem, no sandbox':<40} {raw[0]:>8} {raw[1]:>8}")
    for name, (p50, p99) in rows:
        print(f"{name:<40} {p50:>8} {p99:>8}")


if __name__ == "__main__":
    main()
