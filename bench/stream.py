"""Benchmark: output streaming from one sandbox into the SDK, against the same commands on a local pipe.

Run: python -m bench.stream [--lines N] [--chunk-mib M] [--ticks T]   (starts its own `dsec up` on free
     ports with its own state dir and node id, as a separate process, or uses --nats URL of one running)
Measures, from one busybox sandbox:
  1. 80-byte lines (79 characters + newline) from `yes LINE | head -n N`: lines/s and MB/s through
     `sb.stream()` (one Output event per line, counted) and through `sb.exec()` (bytes returned);
  2. large chunks (`cat` of a 512 KiB file of 64 KiB lines, many times over) through `sb.exec()`: MB/s;
  3. line latency: the sandbox prints `$EPOCHREALTIME` every 10 ms; latency = time the SDK yields the
     line - the time written in it (host and sandbox share the clock); then the same beside a flood
     (another sandbox runs `yes`, past its output cap and drained at a paced rate).
The raw baseline runs the same busybox commands on the host, read through a pipe by this process and
split into lines the same way (libdsec's LineSplitter). MB is 10^6 bytes. The edge caps one exec's
output (EdgeConfig.max_output, 64 MiB, not settable from `dsec up`), so bigger totals are split into
several execs of the same sandbox, one after the other, for both dsec and raw.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import shutil
import signal
import statistics
import string
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import libdsec
from bus.server import die_with_parent, free_port
from cli.demo import percentile
from edge.capacity import EdgeConfig
from libdsec.execstream import LineSplitter

LINE = ((string.ascii_letters + string.digits) * 2)[:79]   # shell-safe, 79 characters
LINE_BYTES = len(LINE) + 1
CHUNK_LINE = (string.ascii_letters * 1261)[:65535] + "\n"    # 64 KiB lines...
CHUNK_DATA = (CHUNK_LINE * 8).encode()                          # ...8 of them: a 512 KiB file, cat'ed many times
CHUNK_PATH = "/tmp/dsec-bench-chunk"
READ = 64 << 10          # raw reads per os.read, as the edge reads a command's pipe
TIMEOUT = 300.0          # per exec
TARGETS = {"lines": 100_000, "chunk_mbs": 100.0, "p99_ms": 20.0}


@dataclass
class Run:
    """What one workload gave: lines (events), bytes, seconds, and a problem if it was not exact."""

    lines: int
    nbytes: int
    seconds: float
    problem: str = ""

    @property
    def lines_per_s(self) -> float:
        """Lines per second."""
        return self.lines / self.seconds

    @property
    def mb_per_s(self) -> float:
        """10^6 bytes per second."""
        return self.nbytes / self.seconds / 1e6


def lines_cmd(n: int, bb: str = "") -> str:
    """n 80-byte lines as fast as busybox prints them (bb: 'busybox ' on the host)."""
    return f"{bb}yes {LINE} | {bb}head -n {n}"


def ticks_cmd(n: int, interval_us: int, bb: str = "") -> str:
    """n lines, one every interval, each its own wall-clock write time (busybox ash's $EPOCHREALTIME)."""
    return f"i=0; while [ $i -lt {n} ]; do echo $EPOCHREALTIME; {bb}usleep {interval_us}; i=$((i+1)); done"


def split(total: int, per_exec: int) -> list[int]:
    """total in near-equal parts of at most per_exec."""
    parts = max(1, math.ceil(total / per_exec))
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def exact(run: Run, lines: int, nbytes: int, what: str) -> Run:
    """Flag a run whose line or byte count is not the expected one."""
    if not run.problem and (run.lines, run.nbytes) != (lines, nbytes):
        run.problem = f"{what}: got {run.lines} lines / {run.nbytes} bytes, expected {lines} / {nbytes}"
    return run


# ---- raw: the same busybox commands on the host, through a pipe --------------------------------------

async def raw_pipe(argv: list[str], on_data) -> str:
    """Run argv with stdout on a pipe, hand each read to on_data; a problem string if it failed."""
    r, w = os.pipe2(os.O_CLOEXEC)
    proc = await asyncio.create_subprocess_exec(*argv, stdout=w)
    os.close(w)
    os.set_blocking(r, False)
    loop, readable = asyncio.get_running_loop(), asyncio.Event()
    loop.add_reader(r, readable.set)
    try:
        while True:
            try:
                data = os.read(r, READ)
            except BlockingIOError:
                readable.clear()
                await readable.wait()
                continue
            if not data:
                break
            on_data(data)
    finally:
        loop.remove_reader(r)
        os.close(r)
    rc = await proc.wait()
    return f"{argv[-1][:40]!r} exited {rc}" if rc else ""


async def raw_lines(parts: list[int], keep_events: bool) -> Run:
    """Lines from `yes | head` on the host: split into events (stream) or collected (exec)."""
    run = Run(0, 0, 0.0)
    t0 = time.perf_counter()
    for n in parts:
        splitter, buf = LineSplitter(), bytearray()

        def on_data(data: bytes) -> None:
            if keep_events:
                for out in splitter.feed("stdout", data):
                    run.lines += 1
                    run.nbytes += len(out.data)
            else:
                buf.extend(data)
        problem = await raw_pipe(["busybox", "sh", "-c", lines_cmd(n, "busybox ")], on_data)
        run.problem = run.problem or problem
        for out in splitter.flush():
            run.lines, run.nbytes = run.lines + 1, run.nbytes + len(out.data)
        if not keep_events:
            run.lines, run.nbytes = run.lines + buf.count(b"\n"), run.nbytes + len(buf)
    run.seconds = time.perf_counter() - t0
    return exact(run, sum(parts), sum(parts) * LINE_BYTES, "raw lines")


async def raw_chunks(copies: list[int], tmp: Path) -> Run:
    """`busybox cat` of the chunk file, `copies` times per command, collected."""
    path = tmp / "chunk"
    path.write_bytes(CHUNK_DATA)
    run = Run(0, 0, 0.0)
    t0 = time.perf_counter()
    for k in copies:
        buf = bytearray()
        problem = await raw_pipe(["busybox", "cat"] + [str(path)] * k, buf.extend)
        run.problem = run.problem or problem
        run.nbytes += len(buf)
        run.lines += buf.count(b"\n")
    run.seconds = time.perf_counter() - t0
    return exact(run, sum(copies) * 8, sum(copies) * len(CHUNK_DATA), "raw chunks")


async def raw_latency(ticks: int, interval_us: int) -> list[float]:
    """Milliseconds from each line's write to its split-out line here."""
    splitter, lat = LineSplitter(), []

    def on_data(data: bytes) -> None:
        for out in splitter.feed("stdout", data):
            lat.append((time.time() - float(out.data)) * 1000)
    problem = await raw_pipe(["busybox", "sh", "-c", ticks_cmd(ticks, interval_us, "busybox ")], on_data)
    if problem or len(lat) != ticks:
        raise SystemExit(f"raw latency run failed: {problem or f'{len(lat)} of {ticks} lines'}")
    return lat


# ---- dsec: the same commands in one sandbox, through the SDK ------------------------------------------

async def dsec_stream_lines(sb: libdsec.AsyncSandbox, parts: list[int]) -> Run:
    """`async for ev in sb.stream(...)`, one Output per line."""
    run = Run(0, 0, 0.0)
    t0 = time.perf_counter()
    for n in parts:
        async for ev in sb.stream(lines_cmd(n), max_output=n * LINE_BYTES, timeout=TIMEOUT):
            if isinstance(ev, libdsec.Output):
                run.lines += 1
                run.nbytes += len(ev.data)
            elif ev.exit_code or ev.truncated or ev.timed_out:
                run.problem = run.problem or f"stream of {n} lines: {ev}"
    run.seconds = time.perf_counter() - t0
    return exact(run, sum(parts), sum(parts) * LINE_BYTES, "dsec stream")


async def dsec_exec_lines(sb: libdsec.AsyncSandbox, parts: list[int]) -> Run:
    """`sb.exec(...)`: the bytes returned (their content checked after the clock stops)."""
    run, results = Run(0, 0, 0.0), []
    t0 = time.perf_counter()
    for n in parts:
        results.append((n, await sb.exec(lines_cmd(n), max_output=n * LINE_BYTES, timeout=TIMEOUT)))
    run.seconds = time.perf_counter() - t0
    for n, r in results:
        run.lines += r.stdout.count(b"\n")
        run.nbytes += len(r.stdout)
        if r.exit_code or r.truncated or r.stdout != (LINE + "\n").encode() * n:
            run.problem = run.problem or f"exec of {n} lines: exit {r.exit_code}, truncated {r.truncated}, wrong bytes"
    return exact(run, sum(parts), sum(parts) * LINE_BYTES, "dsec exec")


async def dsec_chunks(sb: libdsec.AsyncSandbox, copies: list[int]) -> Run:
    """`cat` of the chunk file inside the sandbox (a list command: argv), through sb.exec."""
    half = len(CHUNK_DATA) // 2   # write_file takes at most 700,000 bytes per call
    await sb.write_file(CHUNK_PATH + ".a", CHUNK_DATA[:half])
    await sb.write_file(CHUNK_PATH + ".b", CHUNK_DATA[half:])
    await sb.exec(f"cat {CHUNK_PATH}.a {CHUNK_PATH}.b > {CHUNK_PATH}")
    run, results = Run(0, 0, 0.0), []
    t0 = time.perf_counter()
    for k in copies:
        results.append((k, await sb.exec(["cat"] + [CHUNK_PATH] * k, max_output=k * len(CHUNK_DATA), timeout=TIMEOUT)))
    run.seconds = time.perf_counter() - t0
    for k, r in results:
        run.lines += r.stdout.count(b"\n")
        run.nbytes += len(r.stdout)
        if r.exit_code or r.truncated or r.stdout != CHUNK_DATA * k:
            run.problem = run.problem or f"cat x{k}: exit {r.exit_code}, truncated {r.truncated}, wrong bytes"
    return exact(run, sum(copies) * 8, sum(copies) * len(CHUNK_DATA), "dsec chunks")


async def dsec_latency(sb: libdsec.AsyncSandbox, ticks: int, interval_us: int) -> list[float]:
    """Milliseconds from each line's write inside the sandbox to the SDK yielding it."""
    lat = []
    async for ev in sb.stream(ticks_cmd(ticks, interval_us), timeout=TIMEOUT):
        if isinstance(ev, libdsec.Output):
            lat.append((time.time() - float(ev.data)) * 1000)
        elif ev.exit_code:
            raise SystemExit(f"dsec latency run failed: {ev}")
    if len(lat) != ticks:
        raise SystemExit(f"dsec latency run: {len(lat)} of {ticks} lines")
    return lat


async def dsec_latency_beside_flood(client: libdsec.AsyncClient, sb: libdsec.AsyncSandbox, ticks: int,
                                    interval_us: int) -> tuple[list[float], bool]:
    """The latency run again while another sandbox floods (`yes` until the latency run ends): the
    flood hits its output cap and is drained at a paced rate; the quiet sandbox must not notice."""
    async with await client.create(image="busybox", ttl=600, labels={"job": "bench-stream"}) as flood:
        flooding = asyncio.ensure_future(flood.exec("yes", timeout=max(5.0, ticks * interval_us / 1e6 + 5)))
        await asyncio.sleep(0.5)   # past its first 16 MiB: now it is being drained
        try:
            lat = await dsec_latency(sb, ticks, interval_us)
        finally:
            flooding.cancel()
        try:
            await flooding
        except (asyncio.CancelledError, libdsec.DsecError):
            pass
        return lat, True


# ---- the run ---------------------------------------------------------------------------------------

@dataclass
class Plan:
    """The workloads, already split into execs of at most the edge's cap."""

    line_parts: list[int]
    chunk_copies: list[int]
    ticks: int
    interval_us: int
    cpu: float


async def measure_raw(plan: Plan) -> dict:
    """Every workload on the host."""
    with tempfile.TemporaryDirectory(prefix="dsec-bench-raw-") as tmp:
        await raw_lines([1000], True)   # warm-up
        return {"stream": await raw_lines(plan.line_parts, True), "exec": await raw_lines(plan.line_parts, False),
                "chunks": await raw_chunks(plan.chunk_copies, Path(tmp)),
                "latency": await raw_latency(plan.ticks, plan.interval_us)}


async def measure_dsec(url: str, plan: Plan) -> dict:
    """Every workload in one sandbox."""
    async with libdsec.AsyncClient(url) as client:
        sb = await client.create(image="busybox", resources=libdsec.Resources(cpu=plan.cpu), ttl=600,
                                 labels={"job": "bench-stream"})
        async with sb:
            await dsec_stream_lines(sb, [10_000])   # warm-up: the exec path, the stream, the subscriptions
            return {"stream": await dsec_stream_lines(sb, plan.line_parts),
                    "exec": await dsec_exec_lines(sb, plan.line_parts),
                    "chunks": await dsec_chunks(sb, plan.chunk_copies),
                    "latency": await dsec_latency(sb, plan.ticks, plan.interval_us),
                    "flood": (await dsec_latency_beside_flood(client, sb, plan.ticks, plan.interval_us))[0]}


def report(dsec: dict, raw: dict, plan: Plan, cap: int) -> bool:
    """Print the table and the targets; True when every run was exact."""
    n, execs = sum(plan.line_parts), len(plan.line_parts)
    mib = sum(plan.chunk_copies) * len(CHUNK_DATA) >> 20
    print(f"workloads: {n:,} lines of {LINE_BYTES} bytes in {execs} exec(s); {mib} MiB of 64 KiB lines in "
          f"{len(plan.chunk_copies)} exec(s); {plan.ticks} lines every {plan.interval_us / 1000:g} ms "
          f"(edge cap per exec: {cap >> 20} MiB)")
    print(f"{'figure':<36}{'dsec':>12}{'raw':>12}{'dsec/raw':>10}")
    rows = [("lines/s, stream (Output events)", dsec["stream"].lines_per_s, raw["stream"].lines_per_s),
            ("MB/s, stream (80-byte lines)", dsec["stream"].mb_per_s, raw["stream"].mb_per_s),
            ("lines/s, exec (bytes returned)", dsec["exec"].lines_per_s, raw["exec"].lines_per_s),
            ("MB/s, exec (80-byte lines)", dsec["exec"].mb_per_s, raw["exec"].mb_per_s),
            ("MB/s, exec (large chunks)", dsec["chunks"].mb_per_s, raw["chunks"].mb_per_s)]
    for name, d, r in rows:
        print(f"{name:<36}{d:>12,.1f}{r:>12,.1f}{d / r:>9.3f}x")
    d_lat, r_lat = dsec["latency"], raw["latency"]
    for name, q in (("p50", 50), ("p99", 99), ("max", 100)):
        d, r = percentile(d_lat, q), percentile(r_lat, q)
        print(f"{'line latency ' + name + ' (ms)':<36}{d:>12.2f}{r:>12.3f}{'':>10} (dsec +{d - r:.2f} ms)")
    print(f"{'line latency mean (ms)':<36}{statistics.mean(d_lat):>12.2f}{statistics.mean(r_lat):>12.3f}")
    f_lat = dsec["flood"]
    print(f"{'  beside a flood: p50 / p99 / max':<36}{percentile(f_lat, 50):>7.2f} / {percentile(f_lat, 99):.2f} / "
          f"{percentile(f_lat, 100):.2f} ms (another sandbox runs `yes`)")
    stream_lps, chunk_mbs, p99 = dsec["stream"].lines_per_s, dsec["chunks"].mb_per_s, percentile(d_lat, 99)
    for label, ok in ((f"lines/s >= {TARGETS['lines']:,} (stream, 80-byte lines): {stream_lps:,.0f}",
                       stream_lps >= TARGETS["lines"]),
                      (f"MB/s >= {TARGETS['chunk_mbs']:g} (large chunks): {chunk_mbs:,.1f}", chunk_mbs >= TARGETS["chunk_mbs"]),
                      (f"line latency p99 <= {TARGETS['p99_ms']:g} ms: {p99:.2f} ms", p99 <= TARGETS["p99_ms"]),
                      (f"line latency p99 beside a flood <= {TARGETS['p99_ms']:g} ms: {percentile(f_lat, 99):.2f} ms",
                       percentile(f_lat, 99) <= TARGETS["p99_ms"])):
        print(f"target {'met    ' if ok else 'NOT met'}  {label}")
    problems = [r.problem for side in (dsec, raw) for r in side.values() if isinstance(r, Run) and r.problem]
    for p in problems:
        print(f"PROBLEM: {p}")
    return not problems


# ---- the stack: our own `dsec up`, and proof it left nothing behind -------------------------------------

def leftovers(node: str, state_dir: Path, procs: list) -> list[str]:
    """Mounts under the state dir, the node's cgroups, and processes of the stack still alive."""
    import psutil
    from edge.backends.cgroups import NodeCgroups
    with open("/proc/self/mountinfo") as f:
        found = [f"mount {m}" for m in (ln.split()[4] for ln in f) if m.startswith(f"{state_dir}/") or m == str(state_dir)]
    found += NodeCgroups(node).describe()   # (both trees: latency and batch)
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                found.append(f"process {p.pid} {' '.join(p.cmdline())[:80]}")
    return found


@contextlib.contextmanager
def dsec_up(*extra: str):
    """`dsec up` (plus extra arguments) in its own process group, on free ports, with a temp state dir and a
    unique node id; yields its URL. On the way out: SIGINT, wait, then check nothing is left (mounts,
    cgroups, processes)."""
    import psutil
    node = f"bstream-{os.getpid()}-{os.urandom(3).hex()}"
    tmp = Path(tempfile.mkdtemp(prefix="dsec-bench-stream-"))
    proc = subprocess.Popen([str(Path(sys.executable).parent / "dsec"), "up", "--state-dir", str(tmp), "--port",
                             str(free_port()), "--metrics-port", str(free_port()), "--node-id", node, *extra],
                            stdout=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=die_with_parent)   # a killed bench leaves no `dsec up` behind
    procs: list = []
    try:
        line = proc.stdout.readline().strip()
        if not line.startswith("dsec: ready "):
            raise SystemExit(f"dsec up did not start: {line!r}")
        print(f"dsec up: node {node}, state dir {tmp}" + (" (no auth)" if "--no-auth" in extra else
                                                          " (identities on: the default tenant's credential)"), flush=True)
        os.environ["DSEC_STATE_DIR"] = str(tmp)   # where the SDK finds the credential `dsec up` wrote
        yield line.split()[-1], lambda: procs.extend(psutil.Process(proc.pid).children(recursive=True))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            print("WARNING: dsec up did not stop within 30 s: killed", file=sys.stderr)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        time.sleep(0.2)   # let the servers it stopped be reaped
        left = leftovers(node, tmp, procs)
        for item in left:
            print(f"LEFT BEHIND: {item}", file=sys.stderr)
        if not left:
            shutil.rmtree(tmp, ignore_errors=True)
            print(f"cleanup: dsec up stopped (exit {proc.returncode}); no mounts, cgroups or processes left")


def plan_of(args: argparse.Namespace) -> Plan:
    """Split the workloads into execs the edge's per-exec output cap lets through whole."""
    cap = args.exec_cap
    if cap < len(CHUNK_DATA) or cap < LINE_BYTES:
        raise SystemExit(f"--exec-cap must be at least {len(CHUNK_DATA)} bytes")
    copies = max(1, (args.chunk_mib << 20) // len(CHUNK_DATA))
    return Plan(line_parts=split(args.lines, cap // LINE_BYTES), chunk_copies=split(copies, cap // len(CHUNK_DATA)),
                ticks=args.ticks, interval_us=args.interval_ms * 1000, cpu=args.cpu)


def main(args: argparse.Namespace) -> int:
    """Raw baseline, then the dsec figures, then the table."""
    plan = plan_of(args)
    raw = asyncio.run(measure_raw(plan))
    if args.nats:
        dsec = asyncio.run(measure_dsec(args.nats, plan))
    else:
        with dsec_up(*(["--no-auth"] if args.no_auth else [])) as (url, note_procs):
            note_procs()   # the stack's processes, to check after the stop that none survived
            dsec = asyncio.run(measure_dsec(url, plan))
            note_procs()
    return 0 if report(dsec, raw, plan, args.exec_cap) else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[2:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=1_000_000, help="80-byte lines per line workload (default 1,000,000)")
    ap.add_argument("--chunk-mib", type=int, default=256, help="MiB of large chunks (default 256)")
    ap.add_argument("--ticks", type=int, default=300, help="lines of the latency run (default 300, ~3 s)")
    ap.add_argument("--interval-ms", type=int, default=10, help="ms between latency lines (default 10)")
    ap.add_argument("--cpu", type=float, default=1.0, help="cores of the sandbox (default 1)")
    ap.add_argument("--exec-cap", type=int, default=EdgeConfig().max_output,
                    help="the edge's per-exec output cap in bytes: bigger workloads are split into execs of at most "
                         "this (default %(default)s, EdgeConfig.max_output)")
    ap.add_argument("--nats", default=None, metavar="URL", help="measure an already running `dsec up` at this URL")
    ap.add_argument("--no-auth", action="store_true", help="start `dsec up --no-auth` (no identities)")
    args = ap.parse_args(argv)
    if min(args.lines, args.chunk_mib, args.ticks, args.interval_ms) < 1 or args.cpu <= 0:
        ap.error("--lines, --chunk-mib, --ticks, --interval-ms and --cpu must be positive")
    return args


if __name__ == "__main__":
    sys.exit(main(parse_args()))
