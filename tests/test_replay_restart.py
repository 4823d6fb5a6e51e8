"""The trajectory and output streams are on disk: a reward-model consumer killed mid-job resumes without
loss, and `dsec replay` prints the same bytes after the whole system (`dsec up`) restarted."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

import pytest

import libdsec
from bus.server import free_port
from tests import leaks
from tests.test_output import unmark

pytestmark = pytest.mark.timeout(180)
DSEC = os.path.join(os.path.dirname(sys.executable), "dsec")
NODE = "rr1"
BINARY = bytes(range(256)) * 64 + b"tail without newline"

# A reward model in its own process: reads a job's records with a durable consumer, acks each one and
# prints its id, slowly, so it can be killed in the middle.
READER = textwrap.dedent("""
    import asyncio, sys
    import libdsec

    async def main(url, job, follow):
        async with libdsec.AsyncClient(url) as c:
            async for t in c.trajectories(job=job, durable="reward-a", follow=follow == "1", ack_wait=2.0):
                print(t.record.id, t.record.type, flush=True)
                await t.ack()
                await asyncio.sleep(0.2)

    asyncio.run(main(*sys.argv[1:]))
""")


def start_up(state, port):
    log = open(state / "up.log", "a")
    proc = subprocess.Popen([DSEC, "up", "--state-dir", str(state), "--port", str(port), "--metrics-port", "0",
                             "--node-id", NODE], stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    log.close()
    line = proc.stdout.readline().strip()
    assert line == f"dsec: ready nats://127.0.0.1:{port}", (line, (state / "up.log").read_text()[-3000:])
    return proc


def stop_up(proc):
    os.killpg(proc.pid, signal.SIGINT)
    try:
        assert proc.wait(30) == 0
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


async def test_consumer_killed_mid_job_and_replay_after_a_full_restart(tmp_path, monkeypatch):
    monkeypatch.setenv("DSEC_STATE_DIR", str(tmp_path))   # the credentials `dsec up` writes there
    port = free_port()
    url = f"nats://127.0.0.1:{port}"
    with leaks.live(NODE, tmp_path):
        up = start_up(tmp_path, port)
        try:
            reader = subprocess.Popen([sys.executable, "-c", READER, url, "jr", "1"], stdout=subprocess.PIPE,
                                      text=True)
            async with libdsec.AsyncClient(url) as client:
                sb = await client.create(labels={"job": "jr"})
                await sb.write_file("/tmp/blob", BINARY)
                results = [await sb.exec(["/bin/busybox", "cat", "/tmp/blob"]),
                           await sb.exec("echo out; echo err >&2; exit 5")]
                for i in range(6):
                    results.append(await sb.exec(f"seq 1 {i * 1000}"))
                first = [await asyncio.to_thread(reader.stdout.readline) for _ in range(3)]
                reader.kill()            # SIGKILL mid-job: records it read but did not ack come again
                reader.wait()
                first += reader.stdout.readlines()   # what it printed (and acked) before the kill
                await sb.destroy()
            records = 1 + len(results) + 1  # created, the execs, destroyed
        finally:
            stop_up(up)
        up = start_up(tmp_path, port)    # the whole system again, from its state dir
        try:
            again = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", READER, url, "jr", "0"],
                                            capture_output=True, text=True, timeout=60)
            ids = [line.split()[0] for line in first] + [line.split()[0] for line in again.stdout.splitlines()]
            assert len(set(ids)) == records, (first, again.stdout, again.stderr)
            acked = [line.split()[0] for line in first][:-1]   # the last printed may not have been acked
            assert not set(acked) & {line.split()[0] for line in again.stdout.splitlines()}, "it resumed"
            assert " destroyed" in again.stdout   # (records redelivered after the ack wait may come after it)
            p = await asyncio.to_thread(subprocess.run, [DSEC, "replay", "--sandbox", sb.id, "--nats", url],
                                        capture_output=True, timeout=60)
            assert p.returncode == 0, p.stderr
            replayed = unmark(p.stdout)
        finally:
            stop_up(up)
    assert replayed == [{"stdout": r.stdout, "stderr": r.stderr} for r in results]
    assert results[0].stdout == BINARY and results[1].exit_code == 5
