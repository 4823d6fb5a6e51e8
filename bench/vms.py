"""The microvm and fullvm rows of bench.backends: figures through the SDK, and the same QEMU driven without
the bus (the kind's backend in this process: a bare restore of a template, a bare cold boot to the agent's first frame,
the bare virtio-serial round trip of `true` to the agent) in the same run."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import psutil

import libdsec
from cli.demo import percentile

MEMORY = 256 << 20           # each VM's RAM (bench.backends --vm-memory MiB sets it)


def _p(values: list[float], q: float) -> float:
    return percentile(values, q * 100)


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def _qemus() -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["name"]) if (p.info["name"] or "").startswith("qemu-system")]


async def vm_figures(client: libdsec.AsyncClient, n: int, idle: int, kind: str = "microvm") -> dict:
    """create -> ready p50/p99 and exec p50 (ms), fork of 8 (ms), memory (MiB) and CPU (%) per idle VM."""
    res = libdsec.Resources(memory=f"{MEMORY >> 20}Mi")
    await (await client.create(backend=kind, resources=res, timeout=300)).destroy()   # its template built
    creates, execs = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        sb = await client.create(backend=kind, resources=res, timeout=120)
        creates.append((time.perf_counter() - t0) * 1000)
        await sb.exec(["true"])             # the first command of a new QEMU translates the guest's code
        for _ in range(5):
            e0 = time.perf_counter()
            await sb.exec(["true"])
            execs.append((time.perf_counter() - e0) * 1000)
        await sb.destroy()
    src = await client.create(backend=kind, resources=res, timeout=120)
    await src.exec("echo forked > /root/f")
    snap = await src.snapshot()
    await src.destroy()
    await (await client.fork(snap, 1, backend=kind, resources=res, timeout=300))[0].destroy()   # its template
    t0 = time.perf_counter()
    forks = await client.fork(snap, 8, backend=kind, resources=res, timeout=300)
    fork_ms = (time.perf_counter() - t0) * 1000
    outs = await asyncio.gather(*(f.exec("cat /root/f") for f in forks))
    assert all(o.stdout == b"forked\n" for o in outs), outs
    await asyncio.gather(*(f.destroy() for f in forks))
    src = await client.create(backend=kind, resources=res, timeout=120)   # its memory: a process runs on in forks
    ticker = await src.exec("n=0; while :; do n=$((n+1)); echo $n > /root/c; mv /root/c /root/n; sleep 0.2; done",
                            background=True)
    await src.exec("echo forked > /root/f")
    t0 = time.perf_counter()
    msnap = await src.snapshot(memory=True, timeout=300)
    msnap_ms = (time.perf_counter() - t0) * 1000
    await ticker.kill()
    await src.destroy()
    t0 = time.perf_counter()
    forks = await client.fork(msnap, 8, timeout=300)
    mfork_ms = (time.perf_counter() - t0) * 1000
    outs = await asyncio.gather(*(f.exec("cat /root/f; ps -o args | grep -c '[w]hile :'") for f in forks))
    assert all(o.stdout == b"forked\n1\n" for o in outs), outs
    await asyncio.gather(*(f.destroy() for f in forks))
    await client.delete_snapshot(msnap)
    await asyncio.sleep(2)
    before, qemus_before = _mem_available(), {p.pid for p in _qemus()}
    held, idle_res = [], libdsec.Resources(memory=f"{MEMORY >> 20}Mi", cpu=0.1)   # cpu is booked too
    for _ in range(idle):
        try:
            sb = await client.create(backend=kind, resources=idle_res, timeout=30, ttl=3600)   # holding
            #  a hundred takes minutes under TCG: the first must not reach the default 600 s TTL meanwhile
        except libdsec.CapacityUnavailable:     # the node's booking is full: what it holds is the figure
            break
        await sb.exec(["true"])
        held.append(sb)
    await asyncio.sleep(5)
    procs = [p for p in _qemus() if p.pid not in qemus_before]
    after = _mem_available()
    pss = sum(p.memory_full_info().pss for p in procs)
    rss = sum(p.memory_info().rss for p in procs)
    cpu0 = sum(sum(p.cpu_times()[:2]) for p in procs)
    await asyncio.sleep(5)
    cpu = (sum(sum(p.cpu_times()[:2]) for p in procs) - cpu0) / 5 * 100
    assert len(procs) == len(held), f"{len(held)} VMs held, {len(procs)} QEMUs: one ended while idle"
    await asyncio.gather(*(sb.destroy() for sb in held))
    per = max(len(procs), 1)
    return {"create_p50": _p(creates, 0.5), "create_p99": _p(creates, 0.99), "exec_p50": _p(execs, 0.5),
            "fork8_ms": fork_ms, "msnap_ms": msnap_ms, "mfork8_ms": mfork_ms, "held": len(procs), "avail_mib": (before - after) / per / 2**20,
            "pss_mib": pss / per / 2**20, "rss_mib": rss / per / 2**20, "cpu_pct": cpu / per}


async def bare_vm(tmp: Path, n: int, kind: str = "microvm") -> dict:
    """The same QEMU without the bus: restore p50/p99, 8 restores at once, cold boot p50, exec p50 (ms)."""
    from edge.backends.base import Limits, SandboxSpec
    from edge.backends.fullvm import FullVMBackend
    from edge.backends.microvm import MicroVMBackend
    from edge.erofs import busybox_rootfs, pack_dir
    root, layer = tmp / f"{kind}-root", tmp / f"{kind}-layer.erofs"
    busybox_rootfs(root)
    pack_dir(root, layer)
    b = (FullVMBackend if kind == "fullvm" else MicroVMBackend)(tmp / f"{kind}-bare", f"bench-bare-{kind}")
    await b.start()
    spec = lambda i: SandboxSpec(f"bare{i}", [str(layer)], Limits(memory=MEMORY), kind=kind)  # noqa: E731

    async def sink(_stream, _data: bytes) -> None:
        pass
    try:
        await b.create(spec(0))
        await b.destroy("bare0")
        restores, execs, boots = [], [], []
        for i in range(1, n + 1):
            t0 = time.perf_counter()
            await b.create(spec(i))
            restores.append((time.perf_counter() - t0) * 1000)
            await b.exec(f"bare{i}", ["true"], env={}, cwd="/", stdin=None, timeout=60, sink=sink)
            for _ in range(5):
                e0 = time.perf_counter()
                await b.exec(f"bare{i}", ["true"], env={}, cwd="/", stdin=None, timeout=60, sink=sink)
                execs.append((time.perf_counter() - e0) * 1000)
            await b.destroy(f"bare{i}")
        t0 = time.perf_counter()
        await asyncio.gather(*(b.create(spec(100 + i)) for i in range(8)))
        eight = (time.perf_counter() - t0) * 1000
        await asyncio.gather(*(b.destroy(f"bare{100 + i}") for i in range(8)))
        b.use_templates = False
        for i in range(2):
            t0 = time.perf_counter()
            await b.create(spec(200 + i))
            boots.append((time.perf_counter() - t0) * 1000)
            await b.destroy(f"bare{200 + i}")
    finally:
        await b.stop()
    return {"restore_p50": _p(restores, 0.5), "restore_p99": _p(restores, 0.99), "eight_ms": eight,
            "boot_p50": _p(boots, 0.5), "exec_p50": _p(execs, 0.5)}


def vm_rows(v: dict, bare: dict, kind: str = "microvm") -> list[tuple[str, str, float, float, str]]:
    """bench.backends' table rows for a VM kind."""
    ram = MEMORY / 2**20
    return [(kind, "create -> ready p50 (ms)", v["create_p50"], bare["restore_p50"], "bare restore, no bus, p50"),
            (kind, "create -> ready p99 (ms)", v["create_p99"], bare["restore_p99"], "bare restore, no bus, p99"),
            (kind, "create -> ready p50 (ms)", v["create_p50"], bare["boot_p50"], "bare cold boot to the agent"),
            (kind, "exec `true` round trip p50 (ms)", v["exec_p50"], bare["exec_p50"],
             "bare virtio-serial round trip p50"),
            (kind, "fork of 8 from a snapshot (ms)", v["fork8_ms"], bare["eight_ms"], "8 bare restores at once"),
            (kind, "snapshot(memory=True) (ms)", v["msnap_ms"], bare["restore_p50"], "bare restore, no bus, p50"),
            (kind, "fork of 8 from its memory (ms)", v["mfork8_ms"], bare["eight_ms"], "8 bare restores at once"),
            (kind, f"host MiB / idle VM, MemAvailable ({v['held']})", v["avail_mib"], ram, "the VM's RAM size"),
            (kind, "host MiB / idle VM, PSS", v["pss_mib"], ram, "the VM's RAM size"),
            (kind, "host MiB / idle VM, RSS", v["rss_mib"], ram, "the VM's RAM size"),
            (kind, "host CPU % / idle VM", v["cpu_pct"], 100.0, "one core")]
