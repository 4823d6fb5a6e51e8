"""Lossless, ordered output: what a command writes is what the SDK returns, what its stream shows, what a
plain nats-py consumer reads from dsec.out and what `dsec replay` prints, byte for byte."""
from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
from pathlib import Path


import psutil

import libdsec
from bus import subjects
from tests.conftest import raw_nats

DSEC = str(Path(sys.executable).parent / "dsec")
MIB = 1 << 20
INTERLEAVED = "i=0; while [ $i -lt 2000 ]; do echo out$i; echo err$i >&2; i=$((i+1)); done"


def streams_of(chunks: list[dict]) -> dict[str, bytes]:
    out = {"stdout": b"", "stderr": b""}
    for c in chunks:
        out[c["stream"]] += c["data"] if isinstance(c["data"], bytes) else base64.b64decode(c["data"])
    return out


async def read_plain(url: str, node: str, sandbox: str, exec_id: str) -> list[dict]:
    """dsec.out.<tenant>.<node>.<sandbox>.<exec> read back with plain nats-py: raw chunks framed by headers, then the JSON
    exit record (docs/streams.md); as dicts."""
    nc = await raw_nats(url)
    try:
        sub = await nc.jetstream().subscribe(subjects.output("default", node, sandbox, exec_id), ordered_consumer=True)
        records = []
        while not records or records[-1]["kind"] != "exit":
            m = await sub.next_msg(timeout=10)
            h = m.headers or {}
            if h.get("Dsec-Kind") == "out":
                records.append({"kind": "out", "seq": int(h["Dsec-Seq"]), "stream": h["Dsec-Stream"], "data": m.data,
                                "stream_seq": int(h["Dsec-Stream-Seq"]), "partial": h["Dsec-Partial"] == "1",
                                "exec_id": h["Dsec-Exec"]})
            else:
                records.append(json.loads(m.data))
        await sub.unsubscribe()
    finally:
        await nc.close()
    return records


def check_framing(records: list[dict]) -> None:
    """seq counts every record; stream_seq counts each stream's chunks; partial = the chunk ends inside a line."""
    assert [r["seq"] for r in records] == list(range(1, len(records) + 1))
    for stream in ("stdout", "stderr"):
        chunks = [r for r in records if r["kind"] == "out" and r["stream"] == stream]
        assert [c["stream_seq"] for c in chunks] == list(range(1, len(chunks) + 1))
        for c in chunks:
            assert c["partial"] == (not c["data"].endswith(b"\n"))


def unmark(text: bytes) -> list[dict[str, bytes]]:
    """`dsec replay` text output back to each exec's streams (1| stdout, 2| stderr, \\ no newline at end)."""
    execs: list[dict[str, bytes]] = []
    last = "stdout"
    for line in text.split(b"\n")[:-1]:
        if line.startswith(b"$ "):
            execs.append({"stdout": b"", "stderr": b""})
        elif line[:3] in (b"1| ", b"2| "):
            last = "stdout" if line[:1] == b"1" else "stderr"
            execs[-1][last] += line[3:] + b"\n"
        elif line == b"\\ no newline at end":
            execs[-1][last] = execs[-1][last][:-1]
    return execs


async def test_every_reader_gets_exactly_the_bytes_written(stack, client):
    sb = await client.create(labels={"job": "fidelity"})
    await sb.exec("head -c 300000 /dev/urandom > /tmp/random")
    random_bytes = await sb.read_file("/tmp/random")
    cases = [  # (command, expected stdout, expected stderr)
        (["/bin/busybox", "cat", "/tmp/random"], random_bytes, b""),
        ("head -c 1048576 /dev/zero | tr '\\0' a; echo", b"a" * MIB + b"\n", b""),
        (["/bin/busybox", "seq", "1", "100000"], b"".join(b"%d\n" % i for i in range(1, 100001)), b""),
        (INTERLEAVED, b"".join(b"out%d\n" % i for i in range(2000)), b"".join(b"err%d\n" % i for i in range(2000))),
        ("printf 'a\\nb'; printf 'c' >&2", b"a\nb", b"c"),
    ]
    exec_ids = []
    for cmd, stdout, stderr in cases:
        r = await sb.exec(cmd, timeout=60)
        assert (r.exit_code, r.truncated, r.stdout, r.stderr) == (0, False, stdout, stderr), cmd
        lines = [ev async for ev in sb.stream(cmd, timeout=60)]
        exit_ = lines.pop()
        assert isinstance(exit_, libdsec.Exit) and exit_.exit_code == 0
        seen = {"stdout": b"", "stderr": b""}
        for line in lines:
            assert line.data.endswith(b"\n") or line is lines[-1] or line.stream != lines[-1].stream or \
                not (stdout if line.stream == "stdout" else stderr).endswith(b"\n")
            seen[line.stream] += line.data
        assert (seen["stdout"], seen["stderr"]) == (stdout, stderr), cmd
        assert len(lines) == stdout.count(b"\n") + stderr.count(b"\n") + (not stdout.endswith(b"\n") and bool(stdout)) \
            + (not stderr.endswith(b"\n") and bool(stderr))
        plain = await read_plain(stack.url, sb.node, sb.id, r.exec_id)
        check_framing(plain)
        assert streams_of([c for c in plain if c["kind"] == "out"]) == {"stdout": stdout, "stderr": stderr}
        exec_ids.append(r.exec_id)
    long_line = await read_plain(stack.url, sb.node, sb.id, exec_ids[1])
    assert sum(c.get("partial", False) for c in long_line) >= 4   # 1 MiB line: cut, flagged, rejoined
    await sb.destroy()
    text = await asyncio.to_thread(subprocess.run, [DSEC, "replay", "--sandbox", sb.id, "--nats", stack.url],
                                   capture_output=True, timeout=120)
    js = await asyncio.to_thread(subprocess.run, [DSEC, "replay", "--sandbox", sb.id, "--format", "json",
                                                  "--nats", stack.url], capture_output=True, timeout=120)
    assert text.returncode == 0 and js.returncode == 0, (text.stderr, js.stderr)
    replayed = unmark(text.stdout)[1:]   # after the exec that made /tmp/random
    chunks = [json.loads(line) for line in js.stdout.splitlines()]
    for i, (cmd, stdout, stderr) in enumerate(cases):   # replay shows each exec twice (exec, then stream)
        assert replayed[2 * i + 1] == replayed[2 * i] == {"stdout": stdout, "stderr": stderr}, cmd
        mine = [c for c in chunks if c.get("kind") == "out" and c["exec_id"] == exec_ids[i]]
        assert streams_of(mine) == {"stdout": stdout, "stderr": stderr}, cmd


async def test_a_flood_is_capped_and_does_not_slow_another_sandbox(client):
    edge = psutil.Process(os.getpid())    # the session stack's edge runs in this process
    rss0 = edge.memory_info().rss
    async with await client.create() as flood, await client.create() as quiet:
        flooding = asyncio.ensure_future(flood.exec("timeout 10 yes", timeout=30, max_output=16 * MIB))
        await asyncio.sleep(0.5)
        latencies = []
        peak = 0
        async for ev in quiet.stream("i=0; while [ $i -lt 300 ]; do echo $EPOCHREALTIME; usleep 10000; i=$((i+1)); "
                                     "done", timeout=30):
            if isinstance(ev, libdsec.Output):
                latencies.append(__import__("time").time() - float(ev.data))
                peak = max(peak, edge.memory_info().rss)
        r = await flooding
    assert r.truncated and len(r.stdout) == 16 * MIB and r.stdout[:4] == b"y\ny\n" and r.exit_code == 124 + 19
    latencies.sort()
    assert len(latencies) == 300
    p99 = latencies[int(len(latencies) * 0.99) - 1]
    assert p99 < 0.2, f"line latency p99 {p99 * 1000:.1f} ms beside a flood"   # target 20 ms: see bench.stream
    assert peak - rss0 < 200 * MIB, f"edge RSS grew {(peak - rss0) / MIB:.0f} MiB"


async def test_chunks_as_they_arrive_show_a_line_not_finished(client):
    """stream(lines=False): what a running command printed so far, a partial line too, then the rest;
    the bytes joined are what it wrote."""
    async with await client.create() as sb:
        got: list[tuple[str, bytes]] = []
        agen = sb.stream("printf 'half'; sleep 2; printf ' done\\nnext'; echo tail >&2", lines=False)
        first = await asyncio.wait_for(agen.__anext__(), 1.5)   # long before the command ends
        assert (first.stream, first.data) == ("stdout", b"half")
        async for ev in agen:
            got.append((ev.stream, ev.data) if isinstance(ev, libdsec.Output) else ("exit", ev.exit_code))
        assert got[-1] == ("exit", 0)
        assert b"half" + b"".join(d for s, d in got if s == "stdout") == b"half done\nnext"
        assert b"".join(d for s, d in got if s == "stderr") == b"tail\n"
