"""Benchmark: one tenant's flood of ops against another tenant's ops on the same node (the node's op lane).

Run: python -m bench.oplane [--par 400,1500,4000] [--seconds 15] [--sandboxes 20]
     (starts its own `dsec up` with identities on, and adds tenants `oplanea` and `oplaneb`)
Tenant A has one sandbox; it runs, one after the other, `exec true` and `set_timeout`, and times each.
Tenant B has --sandboxes sandboxes and runs PAR loops of suspend / resume / set_timeout on them (each loop
waits for its op's answer, then sends the next), in a process of its own (in A's, B's thousands of loops
would slow A's client, not the node). The raw baseline is A's same loop in the same run with B idle.
Printed per PAR: A's exec and set_timeout p50 / p95 / max beside the baseline, B's answered ops/s and its
errors by kind (RateLimited is B being told to slow down), and the largest RSS of the `dsec up` process
meanwhile. Then B alone at the largest PAR, for B's own throughput with nobody else on the node.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

import libdsec
from bench.stream import dsec_up
from cli.demo import percentile

R = libdsec.Resources(cpu=0.1, memory="32Mi")
OPS = ("suspend", "resume", "set_timeout")


def ms(xs: list[float]) -> str:
    if not xs:
        return "n=0"
    return (f"n={len(xs)} p50 {percentile(xs, 50) * 1e3:.0f} ms, p95 {percentile(xs, 95) * 1e3:.0f} ms, "
            f"max {max(xs) * 1e3:.0f} ms")


def stack_rss(state: Path) -> int:
    """Bytes resident in the `dsec up` process of this state dir (the edge, placement and API)."""
    for p in psutil.process_iter(["cmdline", "memory_info"]):
        cmd = p.info["cmdline"] or []
        if "up" in cmd and str(state) in cmd:
            return p.info["memory_info"].rss
    return 0


async def probe(sa: libdsec.AsyncSandbox, seconds: float, state: Path) -> dict[str, list[float]]:
    """A's loop: exec and set_timeout, one after the other, for `seconds` (and the stack's largest RSS)."""
    got: dict[str, list] = {"exec": [], "set_timeout": [], "errors": [], "rss": [stack_rss(state)]}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        got["rss"].append(stack_rss(state))
        for what in ("exec", "set_timeout"):
            t = time.perf_counter()
            try:
                if what == "exec":
                    r = await sa.exec(["true"], timeout=120)
                    assert r.exit_code == 0, r
                else:
                    await sa.set_timeout(1800, timeout=120)
                got[what].append(time.perf_counter() - t)
            except libdsec.DsecError as exc:
                got["errors"].append(f"{what}: {type(exc).__name__}")
        await asyncio.sleep(0.05)
    return got


def flood_process(url: str, creds: str, ids: list, par: int, ready, stop, out) -> None:
    """B's PAR loops in a process of their own (in A's, they would slow A's client, not the node), until
    stop is set; out gets (ops answered ok, errors by kind, seconds)."""
    async def run() -> None:
        async with libdsec.AsyncClient(url, creds=creds) as b:
            bs = [await b.get(i) for i in ids]
            halt = asyncio.Event()
            task = asyncio.ensure_future(flood(bs, par, halt))
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.1)
            halt.set()
            out.put(await task)
    asyncio.run(run())


async def flooding(url: str, creds: str, bs: list, par: int, seconds: float, during=None):
    """B's flood in its own process for `seconds` after 3 s of filling the lane, with during() meanwhile."""
    ctx = multiprocessing.get_context("spawn")
    ready, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=flood_process, args=(url, creds, [s.id for s in bs], par, ready, stop, out), daemon=True)
    proc.start()
    try:
        await asyncio.get_running_loop().run_in_executor(None, ready.wait, 60)
        await asyncio.sleep(3)   # B's loops fill the lane first
        got = await during() if during else await asyncio.sleep(seconds)
    finally:
        stop.set()
    result = await asyncio.get_running_loop().run_in_executor(None, out.get, True, 300)
    proc.join(30)
    return got, result


async def flood(bs: list, par: int, stop: asyncio.Event) -> tuple[int, collections.Counter, float]:
    """B's PAR loops until stop: (ops answered ok, errors by kind, seconds)."""
    ok, errors, first = [0], collections.Counter(), {}

    async def loop(i: int) -> None:
        sb, k = bs[i % len(bs)], i
        while not stop.is_set():
            op, k = OPS[k % len(OPS)], k + 1
            try:
                if op == "set_timeout":
                    await sb.set_timeout(1800, timeout=120)
                else:
                    await getattr(sb, op)(timeout=120)
                ok[0] += 1
            except libdsec.DsecError as exc:
                errors[type(exc).__name__] += 1
                first.setdefault(type(exc).__name__, str(exc)[:150])
                if isinstance(exc, libdsec.RateLimited):
                    await asyncio.sleep(0.05)
    t = time.perf_counter()
    await asyncio.gather(*(loop(i) for i in range(par)))
    for kind, text in first.items():
        print(f"  (B's first {kind}: {text})", flush=True)
    return ok[0], errors, time.perf_counter() - t


async def measure(url: str, state: Path, pars: list[int], seconds: float, n: int) -> None:
    creds = state / "creds" / "tenants"
    cb = str(creds / "oplaneb.creds")
    async with libdsec.AsyncClient(url, creds=str(creds / "oplanea.creds")) as a, \
            libdsec.AsyncClient(url, creds=cb) as b:
        sa = await a.create(image="busybox", resources=R, ttl=3600)
        bs = await asyncio.gather(*(b.create(image="busybox", resources=R, ttl=3600) for _ in range(n)))
        base = await probe(sa, seconds, state)
        print(f"baseline (B idle): A exec {ms(base['exec'])}; A set_timeout {ms(base['set_timeout'])}; "
              f"dsec up RSS {max(base['rss']) / 2**20:.0f} MiB", flush=True)
        for par in pars:
            got, (done, errors, secs) = await flooding(url, cb, bs, par, seconds, lambda: probe(sa, seconds, state))
            p50 = percentile(got["exec"], 50) / percentile(base["exec"], 50) if got["exec"] else float("inf")
            print(f"B flood x{par}: A exec {ms(got['exec'])} ({p50:.1f}x baseline p50); A set_timeout "
                  f"{ms(got['set_timeout'])}; A errors {collections.Counter(got['errors']) or 'none'}; "
                  f"B {done / secs:.0f} ops/s answered, B errors {dict(errors) or 'none'}; "
                  f"dsec up RSS {max(got['rss']) / 2**20:.0f} MiB", flush=True)
            await asyncio.gather(*(s.resume(timeout=120) for s in bs), return_exceptions=True)
        _, (done, errors, secs) = await flooding(url, cb, bs, pars[-1], seconds)
        print(f"B alone x{pars[-1]}: {done / secs:.0f} ops/s answered, errors {dict(errors) or 'none'}", flush=True)
        await asyncio.gather(*(s.resume(timeout=120) for s in bs), return_exceptions=True)
        t = time.perf_counter()
        gone = await asyncio.gather(*(s.destroy(timeout=120) for s in bs), return_exceptions=True)
        print(f"B destroys its {n} sandboxes at once: {time.perf_counter() - t:.2f} s, "
              f"errors {collections.Counter(type(x).__name__ for x in gone if x) or 'none'}", flush=True)
        await sa.destroy()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--par", default="400,1500,4000", help="B's parallel op loops, comma-separated (default 400,1500,4000)")
    ap.add_argument("--seconds", type=float, default=15.0, help="A's probe per step (default 15)")
    ap.add_argument("--sandboxes", type=int, default=20, help="B's sandboxes (default 20)")
    args = ap.parse_args(argv)
    pars = [int(p) for p in args.par.split(",")]
    with dsec_up() as (url, _):
        state = Path(os.environ["DSEC_STATE_DIR"])
        for name in ("oplanea", "oplaneb"):
            subprocess.run([str(Path(sys.executable).parent / "dsec"), "iam", "tenant", "add", name,
                            "--state-dir", str(state)], check=True, stdout=subprocess.DEVNULL)
        asyncio.run(measure(url, state, pars, args.seconds, args.sandboxes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
