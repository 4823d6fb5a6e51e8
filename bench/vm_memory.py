"""What each memory technique buys for idle microVMs: host memory (MemAvailable drop) per idle VM for N bare
restored VMs (no bus: the backend in this process), each technique on and off in the same run.

Run: python -m bench.vm_memory [--vms 30] [--vm-memory 256]

  stub kernel   a restore gets guest.stub_kernel instead of the kernel and initrd (on by default; off is
                DSEC_VM_STUB_KERNEL=0): QEMU no longer holds them for the firmware
  KSM           the host's same-page merging over the VMs' anonymous memory (QEMU marks guest RAM
                mergeable), three full scans at 10,000 pages per 20 ms, then ksmd's CPU at a slow pace
  pageout       every idle QEMU's private memory paged out (process_madvise MADV_PAGEOUT) to a zram swap
                device this run adds and removes (lz4), then the first and second `true` in each VM
  DAMON         whether a kdamond of our own could run (a host whose own kdamond runs refuses a second:
                EBUSY), and what the host's does
  DAX           full VMs (--fullvms, 256 MiB): the OS layer a virtio-pmem device read through DAX (on by
                default; off is DSEC_VM_DAX=0: a disk), idle and after each VM read the OS's libraries
                (/usr/lib/x86_64-linux-gnu/*.so*, ~50 MB), and the page cache the read added in the guest
The host's KSM settings, swap and zram devices are put back as they were.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import psutil

from bench.vms import _mem_available
from cli.demo import percentile

KSM = Path("/sys/kernel/mm/ksm")
DAMON = Path("/sys/kernel/mm/damon/admin/kdamonds")
ZRAM = Path("/sys/class/zram-control")
SYS_PIDFD_OPEN, SYS_PROCESS_MADVISE, MADV_PAGEOUT = 434, 440, 21
_libc = ctypes.CDLL(None, use_errno=True)


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def pageout(pid: int) -> None:
    """Page out a process's private writable memory (anonymous, and copy-on-write pages of its file
    mappings; pages it shares with others stay)."""
    ranges = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        span, perms = line.split()[:2]
        if "p" in perms and "w" in perms:
            lo, hi = (int(x, 16) for x in span.split("-"))
            ranges.append(_Iovec(lo, hi - lo))
    fd = _libc.syscall(SYS_PIDFD_OPEN, pid, 0)
    if fd < 0:
        raise OSError(ctypes.get_errno(), f"pidfd_open {pid}")
    try:
        for i in range(0, len(ranges), 512):
            chunk = ranges[i:i + 512]
            if _libc.syscall(SYS_PROCESS_MADVISE, fd, (_Iovec * len(chunk))(*chunk), len(chunk), MADV_PAGEOUT, 0) < 0:
                raise OSError(ctypes.get_errno(), f"process_madvise {pid}")
    finally:
        os.close(fd)


def _ksmd_cpu() -> float:
    return sum(sum(p.cpu_times()[:2]) for p in psutil.process_iter(["name"]) if p.info["name"] == "ksmd")


def _ksm(name: str, value: int | None = None) -> int:
    if value is not None:
        (KSM / name).write_text(str(value))
    return int((KSM / name).read_text())


def damon_state() -> str:
    """Whether a kdamond of ours could run here, and what the host's kdamonds do."""
    if not DAMON.is_dir():
        return "no DAMON sysfs interface"
    n = int((DAMON / "nr_kdamonds").read_text())
    running = [i for i in range(n) if (DAMON / str(i) / "state").read_text().strip() == "on"]
    out = []
    for i in running:
        ctx = DAMON / str(i) / "contexts" / "0"
        ops = (ctx / "operations").read_text().strip()
        schemes = ctx / "schemes"
        actions = [(schemes / s / "action").read_text().strip() for s in sorted(os.listdir(schemes)) if s.isdigit()]
        out.append(f"kdamond {i}: {ops}, {'/'.join(actions) or 'monitoring only'}")
    if running:
        return (f"the host runs {len(running)} kdamond(s) ({'; '.join(out)}): another cannot be added while they "
                f"run (nr_kdamonds is refused, EBUSY), so no per-VM reclaim of ours")
    return f"{n} kdamond(s), none running: a kdamond of ours could run (needs swap for anonymous pages)"


class Swap:
    """A zram swap device of this run (lz4), removed after."""

    def __init__(self, size: int) -> None:
        self.size, self.dev = size, ""

    def __enter__(self) -> "Swap":
        self.dev = "zram" + (ZRAM / "hot_add").read_text().strip()
        block = Path("/sys/block") / self.dev
        (block / "comp_algorithm").write_text("lz4")
        (block / "disksize").write_text(str(self.size))
        subprocess.run(["mkswap", f"/dev/{self.dev}"], check=True, capture_output=True)
        subprocess.run(["swapon", "-p", "100", f"/dev/{self.dev}"], check=True, capture_output=True)
        return self

    def used(self) -> int:
        return int((Path("/sys/block") / self.dev / "mm_stat").read_text().split()[2])

    def __exit__(self, *exc) -> None:
        subprocess.run(["swapoff", f"/dev/{self.dev}"], capture_output=True)
        with contextlib.suppress(OSError):
            (ZRAM / "hot_remove").write_text(self.dev.removeprefix("zram"))


async def run(args) -> list[tuple[str, float, float, str]]:
    from edge.backends.base import Limits, SandboxSpec
    from edge.backends.microvm import MicroVMBackend, qemu
    from edge.erofs import busybox_rootfs, pack_dir

    async def sink(_stream, _data: bytes) -> None:
        pass

    tmp = Path(tempfile.mkdtemp(prefix="vm-memory-"))
    busybox_rootfs(tmp / "root")
    pack_dir(tmp / "root", tmp / "layer.erofs")
    b = MicroVMBackend(tmp / "state", "bench-vm-memory")
    spec = lambda i: SandboxSpec(f"m{i}", [str(tmp / "layer.erofs")], Limits(memory=args.vm_memory << 20))  # noqa: E731
    n, rows = args.vms, []

    async def hold(first: int) -> tuple[list[str], int]:
        await asyncio.sleep(2)
        before = _mem_available()
        ids = []
        for i in range(first, first + n):
            await b.create(spec(i))
            ids.append(f"m{i}")
            await b.exec(ids[-1], ["true"], env={}, cwd="/", stdin=None, timeout=60, sink=sink)
        await asyncio.sleep(5)
        return ids, before

    async def execs(ids: list[str]) -> float:
        ms = []
        for sid in ids:
            t0 = time.perf_counter()
            await b.exec(sid, ["true"], env={}, cwd="/", stdin=None, timeout=60, sink=sink)
            ms.append((time.perf_counter() - t0) * 1000)
        return percentile(ms, 50)

    def per_vm(before: int) -> float:
        return (before - _mem_available()) / n / 2**20

    async def drop(ids: list[str]) -> None:
        await asyncio.gather(*(b.destroy(sid) for sid in ids))

    ksm_saved = {name: _ksm(name) for name in ("run", "pages_to_scan", "sleep_millisecs")}
    await b.start()
    try:
        await b.create(spec(0))            # the template
        await b.destroy("m0")
        qemu.STUB_RESTORES = False
        ids, before = await hold(1000)
        off = per_vm(before)
        await drop(ids)
        qemu.STUB_RESTORES = True
        ids, before = await hold(2000)
        on = per_vm(before)
        rows.append(("stub kernel", on, off, "off: the real kernel and initrd"))
        exec_idle = await execs(ids)

        _ksm("pages_to_scan", 10000)
        _ksm("sleep_millisecs", 20)
        cpu0, scans = _ksmd_cpu(), _ksm("full_scans")
        _ksm("run", 1)
        t0 = time.monotonic()
        while _ksm("full_scans") < scans + 3 and time.monotonic() - t0 < 300:
            await asyncio.sleep(0.5)
        merged = per_vm(before)
        merge_cpu = _ksmd_cpu() - cpu0
        _ksm("pages_to_scan", 100)
        _ksm("sleep_millisecs", 200)
        cpu0 = _ksmd_cpu()
        await asyncio.sleep(10)
        rows.append(("KSM, after 3 full scans", merged, on, f"off; merging took {merge_cpu:.1f} s of ksmd CPU, "
                     f"then {(_ksmd_cpu() - cpu0) / 10 * 100:.1f} % of a core at 100 pages / 200 ms"))
        _ksm("run", 2)                     # unmerged before the next
        while _ksm("pages_shared"):
            await asyncio.sleep(0.2)
        _ksm("run", 0)

        with Swap(n * args.vm_memory << 20) as swap:
            await asyncio.sleep(2)
            base = per_vm(before)
            for sid in ids:
                pageout(b._vms[sid].proc.pid)
            await asyncio.sleep(5)
            paged = per_vm(before)
            zram = swap.used() / n / 2**20
            first = await execs(ids)
            second = await execs(ids)
            after = per_vm(before)
            rows.append(("pageout to zram, idle", paged, base, f"before; zram holds {zram:.1f} MiB/VM"))
            rows.append(("pageout to zram, after 2 execs", after, base, "before"))
            rows.append(("first `true` after pageout (ms)", first, exec_idle, "an idle VM's `true` p50"))
            rows.append(("second `true` after pageout (ms)", second, exec_idle, "an idle VM's `true` p50"))
            await drop(ids)
    finally:
        if _ksm("run") == 1 and ksm_saved["run"] != 1:
            _ksm("run", 2)                 # (unmerges every page before it returns)
        for name, value in ksm_saved.items():
            _ksm(name, value)
        qemu.STUB_RESTORES = True
        await b.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


READ_LIBS = ("c() { awk '/^Cached:/ { print $2 }' /proc/meminfo; }; a=$(c); "
             "cat /usr/lib/x86_64-linux-gnu/*.so* > /dev/null; echo $(( $(c) - a ))")


def _rollup(pid: int) -> dict[str, int]:
    """A process's smaps_rollup figures, in KiB."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        out[key] = int(value.split()[0])
    return out


async def dax_rows(args) -> list[tuple[str, float, float, str]]:
    """Full VMs with the OS layer on virtio-pmem (DAX) and on a disk, each idle and after reading the OS's
    libraries: each QEMU's proportional set (PSS) and its anonymous part (the guest's RAM it has copied:
    a page cache in the guest is there), MiB per VM, and the guest page cache the read added. Per QEMU
    rather than the host's MemAvailable, which a handful of VMs leave within its noise here."""
    from edge.backends import fullvm
    from edge.backends.base import Limits, SandboxSpec
    n, tmp = args.fullvms, Path(tempfile.mkdtemp(prefix="vm-memory-dax-"))
    b = fullvm.FullVMBackend(tmp / "state", "bench-vm-dax")
    spec = lambda sid: SandboxSpec(sid, [], Limits(memory=256 << 20))  # noqa: E731
    figures: dict[bool, list[float]] = {}

    def pss(ids: list[str]) -> list[float]:
        rolls = [_rollup(b._vms[sid].proc.pid) for sid in ids]
        return [sum(r["Pss"] for r in rolls) / len(ids) / 1024, sum(r["Pss_Anon"] for r in rolls) / len(ids) / 1024]
    await b.start()
    try:
        for on in (True, False):
            fullvm.DAX = on
            await b.create(spec(f"t{on:d}"))            # its template
            await b.destroy(f"t{on:d}")
            grown: list[float] = []
            ids = [f"f{on:d}-{i}" for i in range(n)]
            for sid in ids:
                await b.create(spec(sid))
            await asyncio.sleep(5)
            idle = pss(ids)
            for sid in ids:
                out = bytearray()

                async def sink(_stream, data: bytes, out=out) -> None:
                    out.extend(data)
                await b.exec(sid, ["/bin/sh", "-c", READ_LIBS], env={}, cwd="/", stdin=None, timeout=120, sink=sink)
                grown.append(int(out.decode().split()[-1]) / 1024)
            await asyncio.sleep(2)
            figures[on] = [*idle, *pss(ids), percentile(grown, 50)]
            await asyncio.gather(*(b.destroy(sid) for sid in ids))
    finally:
        fullvm.DAX = True
        await b.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    names = ["DAX (full VM): PSS, idle", "  its anonymous part", "DAX: PSS after reading 50 MB",
             "  its anonymous part", "  guest page cache the read added"]
    return [(name, on, off, "the OS layer on a disk") for name, on, off in zip(names, figures[True], figures[False])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--vms", type=int, default=30, help="idle VMs held for each figure (default 30)")
    ap.add_argument("--vm-memory", type=int, default=256, help="MiB of RAM of each VM (default 256)")
    ap.add_argument("--fullvms", type=int, default=6, help="full VMs held for each DAX figure (0: none; default 6)")
    args = ap.parse_args()
    rows = asyncio.run(run(args)) if args.vms else []
    if args.fullvms:
        rows += asyncio.run(dax_rows(args))
    print(f"{'technique (MiB per VM)':<34} {'on':>8} {'off':>8} {'ratio':>6}  off is")
    for what, on, off, note in rows:
        print(f"{what:<34} {on:>8.1f} {off:>8.1f} {on / off if off else 0:>6.2f}  {note}")
    print(f"({args.vms} idle {args.vm_memory} MiB microVMs, {args.fullvms} full VMs of 256 MiB; "
          f"DAMON: {damon_state()})")


if __name__ == "__main__":
    main()
