"""Benchmark: one row per backend kind, each beside a raw baseline measured in the same run.

Run: python -m bench.backends [--calls 2000] [--in-flight 64] [--samples 200] [--kinds fncall,...]
     (starts its own `dsec up --backend container --backend fncall --backend gvisor`, or only the
     --kinds given, on free ports, in a temp dir)

  container  create -> ready p50 and exec `true` round trip p50 through the SDK; baseline: a raw
             five-namespace `unshare` of /bin/true.
  gvisor     create -> ready p50 and exec `true` round trip p50 through the SDK; baselines: a bare
             `runsc run` of /bin/true and a bare `runsc exec` of /bin/true (same platform and flags).
  fncall     one `echo hi` call p50/p99 through the SDK, and calls/s with --in-flight at once;
             baselines: the same pool of workers driven locally (FnCallBackend.call, no bus) and a
             fresh `unshare` per call (8 at once). Then the CPU per call of that throughput run, by
             part (commands, edge, SDK, nats-server) and for the whole host.
  microvm    create -> ready p50/p99 (from a template) and exec `true` p50 through the SDK, fork of 8
             from a snapshot's files, snapshot(memory=True) and fork of 8 from it (a process running on
             in each), host memory per idle VM (MemAvailable drop and PSS over --idle-vms VMs)
             and the host CPU they burn idle (each memory technique on and off: bench.vm_memory);
             baselines: the same QEMU driven without the bus (a
             bare restore of the template, a bare cold boot to the agent's first frame, and the bare
             virtio-serial round trip of `true` to the agent).
  fullvm     the same figures for full VMs (q35, Debian with systemd), beside the same QEMU without the bus.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import libdsec
from bench.cycle import raw_baseline
from bus.server import die_with_parent, free_port
from cli.demo import percentile

DSEC = str(Path(sys.executable).with_name("dsec"))
KINDS = ("container", "fncall", "gvisor", "microvm", "fullvm")
VMS = ("microvm", "fullvm")
UNSHARE = ["unshare", "--user", "--map-root-user", "--fork", "--pid", "--mount", "--net", "--uts", "--ipc",
           "--mount-proc", "/bin/echo", "hi"]


def ms(values: list[float], q: float) -> float:
    return percentile(values, q * 100)


async def sandbox_figures(client: libdsec.AsyncClient, kind: str, n: int) -> dict:
    """create -> ready and exec `true` p50 (ms) of one kind."""
    await (await client.create(backend=kind)).destroy()   # layers fetched, helpers warm
    creates, execs = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        sb = await client.create(backend=kind)
        creates.append((time.perf_counter() - t0) * 1000)
        for _ in range(5):
            e0 = time.perf_counter()
            await sb.exec(["true"])
            execs.append((time.perf_counter() - e0) * 1000)
        await sb.destroy()
    return {"create_p50": ms(creates, 0.5), "exec_p50": ms(execs, 0.5)}


async def sdk_figures(url: str, args) -> dict:
    """Container and gVisor create/exec p50, and fncall latency/throughput, through the SDK."""
    out: dict = {}
    async with libdsec.AsyncClient(url) as client:
        for kind in ("container", "gvisor"):
            if kind in args.kinds:
                out[kind] = await sandbox_figures(client, kind, args.samples // 10 or 1)
        for kind in VMS:
            if kind in args.kinds:
                from bench.vms import vm_figures
                out[kind] = await vm_figures(client, args.samples // 10 or 1, args.idle_vms, kind)
        if "fncall" not in args.kinds:
            return out
        for _ in range(20):   # workers started, layers fetched
            assert (await client.call(["echo", "hi"])).stdout == b"hi\n"
        one = []
        for _ in range(args.samples):
            t0 = time.perf_counter()
            r = await client.call(["echo", "hi"])
            one.append((time.perf_counter() - t0) * 1000)
            assert r.ok
        sem = asyncio.Semaphore(args.in_flight)

        async def call() -> None:
            async with sem:
                r = await client.call(["echo", "hi"], wait=120)
                assert r.stdout == b"hi\n", r

        cpu0, t0 = cpu_split(args.up_pid), time.perf_counter()
        await asyncio.gather(*(call() for _ in range(args.calls)))
        rate, cpu1 = args.calls / (time.perf_counter() - t0), cpu_split(args.up_pid)
        out["fncall"] = {"p50": ms(one, 0.5), "p99": ms(one, 0.99), "rate": rate,
                         "cpu": {k: (cpu1[k] - cpu0.get(k, 0.0)) / args.calls * 1000 for k in cpu1}}
    return out


def cpu_split(up_pid: int) -> dict[str, float]:
    """CPU seconds used so far: by the commands and their workers' exec servers (dsec-enter and the
    children it reaped), the rest of `dsec up` (the edge), its nats-server, this process (the SDK), and
    the whole host (busy, irq time included)."""
    import psutil
    split = {"commands": 0.0, "edge": 0.0, "nats-server": 0.0}
    up = psutil.Process(up_pid)
    for p in [up, *up.children(recursive=True)]:
        try:
            name, t = p.name(), p.cpu_times()
        except psutil.Error:
            continue
        if name == "dsec-enter":
            split["commands"] += t.user + t.system + t.children_user + t.children_system
        elif name == "nats-server":
            split["nats-server"] += t.user + t.system
        elif p.pid == up_pid:
            split["edge"] += t.user + t.system
    me, host = psutil.Process().cpu_times(), psutil.cpu_times()
    split["SDK"] = me.user + me.system
    split["host"] = host.user + host.nice + host.system + host.irq + host.softirq
    return split


async def local_pool(args, state: Path) -> dict:
    """The same workers without the bus: FnCallBackend.call straight from this process."""
    from edge.backends.fncall import CallSpec, FnCallBackend
    from edge.backends.base import Limits
    from edge.erofs import busybox_rootfs, pack_dir
    root = state / "bb"
    root.mkdir()
    busybox_rootfs(root)
    layer = state / "bb.erofs"
    pack_dir(root, layer)
    backend = FnCallBackend(state / "local", "benchlocal", workers_min=2, workers_max=args.workers)
    await backend.start()
    try:
        spec = CallSpec(layers=[str(layer)], limits=Limits(), argv=["echo", "hi"])
        for _ in range(20):
            await backend.call(spec)
        one = []
        for _ in range(args.samples):
            t0 = time.perf_counter()
            await backend.call(spec)
            one.append((time.perf_counter() - t0) * 1000)
        sem = asyncio.Semaphore(args.in_flight)

        async def call() -> None:
            async with sem:
                o = await backend.call(spec)
                assert o.stdout == b"hi\n"

        t0 = time.perf_counter()
        await asyncio.gather(*(call() for _ in range(args.calls)))
        return {"p50": ms(one, 0.5), "rate": args.calls / (time.perf_counter() - t0)}
    finally:
        await backend.stop()


def fresh_unshare(n: int) -> dict:
    """A fresh set of namespaces per call, 8 at once."""
    t0 = time.perf_counter()
    running: list[subprocess.Popen] = []
    done = 0
    while done < n:
        while len(running) < 8 and done + len(running) < n:
            running.append(subprocess.Popen(UNSHARE, stdout=subprocess.DEVNULL))
        running.pop(0).wait()
        done += 1
    return {"rate": n / (time.perf_counter() - t0)}


def bare_runsc(tmp: Path, n: int) -> dict:
    """p50 (ms) of a bare `runsc run` of /bin/true and of a bare `runsc exec` of /bin/true into a running
    container, over a plain busybox root dir, with the gvisor backend's platform and network flags."""
    import json
    from edge.erofs import busybox_rootfs
    root, bundle = tmp / "bare-root", tmp / "bare-bundle"
    root.mkdir()
    busybox_rootfs(root)
    bundle.mkdir()
    flags = ["runsc", f"--root={tmp / 'bare-state'}", "--platform=ptrace", "--network=none", "--ignore-cgroups"]
    spec = {"ociVersion": "1.0.2", "root": {"path": str(root), "readonly": True}, "hostname": "bare",
            "process": {"user": {"uid": 0, "gid": 0}, "args": ["/bin/true"], "cwd": "/", "env": ["PATH=/bin"]},
            "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}],
            "linux": {"namespaces": [{"type": t} for t in ("pid", "mount", "ipc", "uts", "network")]}}
    quiet = dict(stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    (bundle / "config.json").write_text(json.dumps(spec))
    runs, execs = [], []
    for i in range(n):
        t0 = time.perf_counter()
        subprocess.run([*flags, "run", "--bundle", str(bundle), f"run{i}"], **quiet)
        runs.append((time.perf_counter() - t0) * 1000)
    spec["process"]["args"] = ["/bin/sleep", "600"]
    (bundle / "config.json").write_text(json.dumps(spec))
    subprocess.run([*flags, "run", "--detach", "--bundle", str(bundle), "held"], **quiet)
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            subprocess.run([*flags, "exec", "held", "/bin/true"], **quiet)
            execs.append((time.perf_counter() - t0) * 1000)
    finally:
        subprocess.run([*flags, "delete", "--force", "held"], capture_output=True)
    return {"run_p50": ms(runs, 0.5), "exec_p50": ms(execs, 0.5)}


def start_up(state: Path, port: int, workers: int, kinds: list[str], memory_fraction: float = 0.8) -> subprocess.Popen:
    proc = subprocess.Popen([DSEC, "up", "--state-dir", str(state), "--port", str(port), "--metrics-port", "0",
                             "--node-id", "bench-kinds", *(a for k in kinds for a in ("--backend", k)),
                             "--memory-fraction", str(memory_fraction),
                             "--fncall-min", "2", "--fncall-max", str(workers)],
                            stdout=subprocess.PIPE, stderr=open(state.parent / "up.log", "ab"), text=True,
                            preexec_fn=die_with_parent)
    os.environ["DSEC_STATE_DIR"] = str(state)   # where the SDK finds the credential `dsec up` wrote
    line = proc.stdout.readline()
    if not line.startswith("dsec: ready"):
        proc.kill()
        raise SystemExit(f"dsec up did not start: {line!r}; see {state.parent / 'up.log'}")
    return proc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000, help="calls in the throughput runs")
    ap.add_argument("--in-flight", type=int, default=64, help="calls at once in the throughput runs")
    ap.add_argument("--samples", type=int, default=200, help="sequential samples for the latency figures")
    ap.add_argument("--workers", type=int, default=32, help="fncall workers at most")
    ap.add_argument("--kinds", default=",".join(KINDS), help="the backends to run and measure, comma-separated")
    ap.add_argument("--idle-vms", type=int, default=10, help="idle VMs (of each VM kind) held for the memory figure")
    ap.add_argument("--vm-memory", type=int, default=256, help="MiB of RAM of each VM (a full VM needs 256 at least)")
    ap.add_argument("--memory-fraction", type=float, default=0.8,
                    help="share of RAM the node may book (dsec up --memory-fraction): a VM books its RAM + 96 MiB "
                         "(160 for a full VM)")
    args = ap.parse_args()
    args.kinds = [k for k in args.kinds.split(",") if k]
    if set(VMS) & set(args.kinds):
        import bench.vms
        bench.vms.MEMORY = args.vm_memory << 20
    if not args.kinds or set(args.kinds) - set(KINDS):
        ap.error(f"--kinds: one or more of {', '.join(KINDS)}")
    with tempfile.TemporaryDirectory(prefix="dsec-bench-kinds-") as tmp:
        tmp_path = Path(tmp)
        port = free_port()
        up = start_up(tmp_path / "up", port, args.workers, args.kinds, args.memory_fraction)
        args.up_pid = up.pid
        try:
            sdk = asyncio.run(sdk_figures(f"nats://127.0.0.1:{port}", args))
        finally:
            up.send_signal(signal.SIGINT)
            up.wait(timeout=20)
        rows = []
        if "container" in args.kinds:
            c, raw50 = sdk["container"], ms(raw_baseline(50), 0.5)
            rows += [("container", "create -> ready p50 (ms)", c["create_p50"], raw50, "raw unshare of /bin/true p50"),
                     ("container", "exec `true` round trip p50 (ms)", c["exec_p50"], raw50,
                      "raw unshare of /bin/true p50")]
        if "gvisor" in args.kinds:
            g, bare = sdk["gvisor"], bare_runsc(tmp_path, 20)
            rows += [("gvisor", "create -> ready p50 (ms)", g["create_p50"], bare["run_p50"],
                      "bare runsc run of /bin/true p50"),
                     ("gvisor", "exec `true` round trip p50 (ms)", g["exec_p50"], bare["exec_p50"],
                      "bare runsc exec p50")]
        if "fncall" in args.kinds:
            f, local, fresh = sdk["fncall"], asyncio.run(local_pool(args, tmp_path)), fresh_unshare(min(args.calls, 500))
            rows += [("fncall", "one call p50 (ms)", f["p50"], local["p50"], "local pool, no bus, p50"),
                     ("fncall", "one call p99 (ms)", f["p99"], local["p50"], "local pool, no bus, p50"),
                     ("fncall", f"calls/s, {args.in_flight} in flight", f["rate"], local["rate"], "local pool, no bus"),
                     ("fncall", f"calls/s, {args.in_flight} in flight", f["rate"], fresh["rate"],
                      "fresh unshare per call (8 at once)")]
        for kind in VMS:
            if kind in args.kinds:
                from bench.vms import bare_vm, vm_rows
                bare = asyncio.run(bare_vm(tmp_path, args.samples // 10 or 1, kind))
                rows += vm_rows(sdk[kind], bare, kind)
                if "container" in args.kinds:   # the bound: container exec + bare round trip + 1 ms
                    rows.append((kind, "exec `true` p50 vs its bound (ms)", sdk[kind]["exec_p50"],
                                 sdk["container"]["exec_p50"] + bare["exec_p50"] + 1.0,
                                 "container exec + bare virtio-serial round trip + 1 ms"))
    print(f"{'backend':<10} {'figure':<34} {'DSec':>10} {'baseline':>10} {'ratio':>7}  baseline is")
    for kind, what, ours, base, note in rows:
        ratio = f"{ours / base:>7.2f}" if base else f"{'-':>7}"
        print(f"{kind:<10} {what:<34} {ours:>10.2f} {base:>10.2f} {ratio}  {note}")
    print(f"(cores: {os.cpu_count()}; fncall workers at most {args.workers})")
    if "fncall" in args.kinds:
        c = sdk["fncall"]["cpu"]
        print(f"fncall CPU per call, {args.in_flight} in flight (ms): commands and their exec servers "
              f"{c['commands']:.2f}, edge {c['edge']:.2f}, SDK {c['SDK']:.2f}, nats-server {c['nats-server']:.2f}; "
              f"the host busy {c['host']:.2f} of {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
