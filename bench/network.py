"""Benchmark: Aether (issue 16). Beside a raw baseline measured in the same run:
- create p50 with network="proxied" and with network="none" (target: proxied adds at most 2 ms), and a raw
  `unshare` launch;
- download throughput through the proxy from inside a sandbox, against the same download straight from the
  host over the same upstream link (target: at least 0.5x);
- sb.set_network: how long until the new policy is in force (its round trip);
- a cached 1 MiB wheel from the node's pip mirror, inside a sandbox (target: p50 <= 5 ms), and a cached
  1 MiB .deb from its apt mirror;
- N sandboxes installing the same wheel through the mirror: how often the upstream index served it;
- with --vm-creates N: a microVM create without and with a network (its tap, bridge and guest setup).

Run: python -m bench.network [--creates N] [--mib N]   (starts its own stack in this process, with an upstream
     HTTP server in a network namespace of its own on 198.51.100.0/24: nothing leaves the machine)
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import libdsec
from bench.cycle import RAW, raw_baseline
from cli.demo import percentile

UP = "198.51.100.2"


def fig(name: str, values: list[float], unit: str = "ms") -> str:
    return f"  {name:<24} p50 {statistics.median(values):8.2f} {unit}  p99 {percentile(values, 99):8.2f} {unit}"


async def creates(client, n: int, network, backend: str = "container", first_exec: bool = False) -> list[float]:
    """Create times (ms); first_exec: each until its first command (`true`) returned."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        sb = await client.create("busybox", network=network, backend=backend, timeout=120)
        if first_exec:
            await sb.exec("true")
        out.append((time.perf_counter() - t0) * 1000)
        await sb.destroy()
    return out


def host_download(size: int) -> float:
    """MiB/s of busybox wget from the host straight to the upstream."""
    t0 = time.perf_counter()
    subprocess.run(["busybox", "wget", "-q", "-O", "/dev/null", f"http://{UP}/bytes/{size}"], check=True)
    return size / (1 << 20) / (time.perf_counter() - t0)


async def sandbox_download(sb, size: int) -> float:
    """MiB/s of the same download from inside a sandbox, through the proxy: the exec's round trip less that
    of an empty one (busybox's date has no nanoseconds)."""
    t0 = time.perf_counter()
    await sb.exec("true")
    t1 = time.perf_counter()
    r = await sb.exec(f"wget -q -O /dev/null http://allowed.test/bytes/{size}", timeout=120)
    t2 = time.perf_counter()
    assert r.exit_code == 0, r.stderr
    return size / (1 << 20) / ((t2 - t1) - (t1 - t0))


async def kind_creates(client, kind: str, n: int) -> None:
    """Creates of one kind (a microVM's from its template; gvisor's by runsc) without and with a network,
    sequential, interleaved by fives: a VM's tap, bridge and guest setup by the trusted shell; gVisor's
    netstack taking its veth."""
    allow = libdsec.Network(allow=["allowed.test"])
    await creates(client, 2, None, kind)         # a microVM template is built by the first
    await creates(client, 2, allow, kind)
    for first_exec in (False, True):
        none, proxied = [], []
        for _ in range(max(1, n // 5)):
            none += await creates(client, 5, None, kind, first_exec=first_exec)
            proxied += await creates(client, 5, allow, kind, first_exec=first_exec)
        print(f"{kind} create{' and its first command (`true`)' if first_exec else ''} ({len(none)} each, "
              f"interleaved by fives; this machine's accelerator):")
        print(fig("network none", none))
        print(fig("network proxied", proxied))
        print(f"  proxied adds {statistics.median(proxied) - statistics.median(none):+.2f} ms at p50")


async def measure(url: str, n: int, mib: int, logs: Path | None = None, n_installs: int = 0,
                  n_vm: int = 0, n_gvisor: int = 0) -> None:
    async with libdsec.AsyncClient(url) as client:
        await creates(client, 5, None)                              # warm-up: layer fetch, mounts
        await creates(client, 5, libdsec.Network(allow=["allowed.test"]))
        # Apart first (each run alone: a proxied run pays for refilling the pool of namespaces it drains),
        # then interleaved (the refill lands on both kinds of create alike).
        await asyncio.sleep(1.0)
        none = await creates(client, n, None)
        proxied = await creates(client, n, libdsec.Network(allow=["allowed.test"]))
        print(f"create ({n} each, sequential, one run of each):")
        print(fig("network none", none))
        print(fig("network proxied", proxied))
        print(f"  proxied adds {statistics.median(proxied) - statistics.median(none):+.2f} ms at p50 "
              f"(target <= 2 ms)")
        none, proxied = [], []
        for _ in range(max(1, n // 10)):
            none += await creates(client, 10, None)
            proxied += await creates(client, 10, libdsec.Network(allow=["allowed.test"]))
        print(f"create ({len(none)} each, interleaved by tens):")
        print(fig("network none", none))
        print(fig("network proxied", proxied))
        size = mib << 20
        fast = libdsec.Network(allow=["allowed.test"], bandwidth="3Gi")   # not the 100 Mbit/s default cap
        async with await client.create("busybox", network=fast) as sb:
            direct = [host_download(size) for _ in range(3)]
            through = [await sandbox_download(sb, size) for _ in range(3)]
            print(f"throughput ({mib} MiB over HTTP, best of 3):")
            print(f"  direct from the host     {max(direct):8.1f} MiB/s")
            print(f"  through the proxy        {max(through):8.1f} MiB/s  ({max(through) / max(direct):.2f}x "
                  f"direct; target >= 0.5x; relay: splice(2))")
            capped = libdsec.Network(allow=["allowed.test"], bandwidth="10Mi")
            await sb.set_network(capped)
            print(f"  with bandwidth=10Mi      {await sandbox_download(sb, 32 << 20):8.1f} MiB/s")
            times = []
            for i in range(50):
                policy = libdsec.Network(allow=["allowed.test"] + (["other.test"] if i % 2 else []))
                t0 = time.perf_counter()
                await sb.set_network(policy)
                times.append((time.perf_counter() - t0) * 1000)
            print("set_network (in force when it returns):")
            print(fig("round trip", times))
        await cached_file(client, "wheel from the node's pip mirror", WHEEL_URL)
        await cached_file(client, ".deb from the node's apt mirror", DEB_URL, proxy=f"http://{GATEWAY}:3142")
        if n_vm:
            await kind_creates(client, "microvm", n_vm)
        if n_gvisor:
            await kind_creates(client, "gvisor", n_gvisor)
        if n_installs:
            await installs(client, url, logs, n_installs)


async def installs(client, url: str, logs: Path, n: int) -> None:
    """n sandboxes (mirror-only, Debian with pip) install the same wheel at once: time, and how often the
    upstream index served the file."""
    import sys
    dsec = str(Path(sys.executable).parent / "dsec")
    r = await asyncio.to_thread(subprocess.run, [dsec, "image", "build", "--nats", url, "pip", "--debootstrap",
                                                 "bookworm", "--packages", "python3-pip"], capture_output=True,
                                text=True, timeout=1500)
    assert r.returncode == 0, r.stderr[-1000:]
    sem = asyncio.Semaphore(16)                 # the node's slots

    async def one() -> float:
        async with sem:
            async with await client.create("pip", network="mirror-only") as sb:
                t0 = time.perf_counter()
                r = await sb.exec("pip install --no-cache-dir --break-system-packages -q "
                                  "--disable-pip-version-check dsecdemo", timeout=300)
                assert r.exit_code == 0, r.stderr[-500:]
                return time.perf_counter() - t0
    t0 = time.perf_counter()
    times = await asyncio.gather(*(one() for _ in range(n)))
    wall = time.perf_counter() - t0
    served = (logs / "pypi.log").read_text().count('"GET /packages/dsecdemo-1.0-py3-none-any.whl ')
    print(f"{n} sandboxes installing the same wheel through the mirror (16 at once): {wall:.1f} s, install p50 "
          f"{statistics.median(times):.2f} s; upstream served the wheel {served} time(s)")


GATEWAY = "$(ip route | awk '/default/ {print $3}')"
WHEEL_URL = f"http://{GATEWAY}:3141/index/dsecdemo/dsecdemo-1.0-py3-none-any.whl"
DEB_URL = "http://deb.debian.org/debian/pool/main/dsecdemo_1.0_all.deb"


async def cached_file(client, what: str, url: str, proxy: str = "", n: int = 50) -> None:
    """p50 of a 1 MiB file from one of the node's mirrors, once cached, from inside a mirror-only sandbox: n
    downloads in one exec, less an empty exec, over n. proxy: the sandbox's http_proxy for it (apt's way to
    its mirror), else straight (pip's: NO_PROXY names the gateway; busybox wget reads no NO_PROXY)."""
    env = f"export http_proxy={proxy}" if proxy else "unset http_proxy HTTP_PROXY"
    async with await client.create("busybox", network="mirror-only") as sb:
        r = await sb.exec(f"{env}; wget -q -O /dev/null {url}", timeout=60)   # the mirror fetches it upstream once
        assert r.exit_code == 0, r.stderr
        rounds = []
        for _ in range(5):
            t0 = time.perf_counter()
            await sb.exec("true")
            t1 = time.perf_counter()
            r = await sb.exec(f"{env}; u={url}; i=0; while [ $i -lt {n} ]; do wget -q -O /dev/null $u || exit 1; "
                              f"i=$((i+1)); done", timeout=120)
            t2 = time.perf_counter()
            assert r.exit_code == 0, r.stderr
            rounds.append(((t2 - t1) - (t1 - t0)) * 1000 / n)
        print(f"cached 1 MiB {what}, inside a sandbox ({n} x 5 rounds):")
        print(f"  per download            p50 {statistics.median(rounds):8.2f} ms  (target <= 5 ms; busybox wget, "
              f"a process each)")


def main(n: int, mib: int, raw_n: int, n_installs: int, n_vm: int, n_gvisor: int) -> None:
    from cli.stack import Stack
    from edge.backends.registry import config_for
    from edge.capacity import EdgeConfig
    from tests import upstreams
    raw = raw_baseline(raw_n)
    print(f"raw baseline: {' '.join(RAW)}")
    print(fig("raw launch", raw))
    with tempfile.TemporaryDirectory(prefix="dsec-bench-net-") as tmp, \
            upstreams.running(Path(tmp), ns="aetherbench", link="aetherbench0") as logs:
        async def run() -> None:
            from bus.server import free_port
            kinds = ["container"] + (["microvm"] if n_vm else []) + (["gvisor"] if n_gvisor else [])
            st = Stack(Path(tmp) / "state", port=free_port(), metrics_port=None,
                       backends=[config_for(k) for k in kinds],
                       edge_config=EdgeConfig(node_id="bench-net", slots=16, aether_dns=f"{UP}:53", backends=kinds,
                                              aether_allow_cidr=["198.51.100.0/24"],
                                              mirror_pypi=f"http://{UP}:8080/simple/",
                                              mirror_apt=f"http://{UP}:8081/debian"))
            await st.start()
            try:
                await measure(st.url, n, mib, logs, n_installs, n_vm, n_gvisor)
            finally:
                await st.stop()
        asyncio.run(run())


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--creates", type=int, default=100, help="creates of each kind (default 100)")
    ap.add_argument("--mib", type=int, default=256, help="MiB per download (default 256)")
    ap.add_argument("--raw", type=int, default=50, help="raw baseline launches (default 50)")
    ap.add_argument("--installs", type=int, default=100,
                    help="sandboxes installing one wheel through the mirror (default 100; 0: skip; builds a Debian "
                         "image with pip the first time)")
    ap.add_argument("--vm-creates", type=int, default=0,
                    help="microVM creates without and with a network (default 0: skip)")
    ap.add_argument("--gvisor-creates", type=int, default=0,
                    help="gVisor creates without and with a network (default 0: skip)")
    args = ap.parse_args()
    main(args.creates, args.mib, args.raw, args.installs, args.vm_creates, args.gvisor_creates)
