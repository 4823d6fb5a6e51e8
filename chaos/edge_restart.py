"""Chaos: SIGKILL the edge in the middle of a burst of creates, restart it, and account for every request.

Run: python -m chaos.edge_restart [--creates 40]
Prints one verdict line:
  verdict: submitted=N completed=N failed=N (reasons) lost=N duplicated=N leaked=N -> PASS|FAIL
- completed: got a sandbox that answered `echo`; failed: a typed error (e.g. node_lost for sandboxes the
  dead edge ran); lost: no outcome within the deadline; duplicated: two sandboxes for one request;
  leaked: mounts, cgroups or processes of the node left after everything stopped. PASS needs no lost,
  duplicated or leaked request, every failure typed (node_lost, capacity_unavailable, expired), and 4
  creates sent after the restart all served.
Identities are on: the server enforces accounts made before it starts; placement, the edge, the
client and the record check each connect as their own principal.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import libdsec
from bus import streams
from bus.records import sandbox_decoder
from bus.server import NatsServer, die_with_parent, free_port

NODE = "chaos-edge"
VERBOSE = "-v" in sys.argv
# What a client may be told when the node under its sandbox dies; anything else (a generic "node
# unavailable" after a timeout) means a request waited out its deadline without an answer.
TYPED_FAILURES = {"node_lost", "capacity_unavailable", "expired"}


def start_edge(url: str, state: Path, creds: str) -> subprocess.Popen:
    """`dsec edge` as a separate process, like a node agent on its own machine."""
    proc = subprocess.Popen([str(Path(sys.executable).parent / "dsec"), "edge", "--nats", url, "--node-id", NODE,
                             "--backend", "container", "--state-dir", str(state), "--creds", creds], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            preexec_fn=die_with_parent)
    if not proc.stdout.readline().startswith("dsec: edge"):
        raise SystemExit("verdict: edge did not start -> FAIL")
    return proc


async def one(client: libdsec.AsyncClient, outcomes: collections.Counter, ids: list[str]) -> None:
    """One create -> echo; record its outcome."""
    try:
        sb = await client.create(timeout=45)
        ids.append(sb.id)
        r = await sb.exec("echo ok", timeout=10)
        outcomes["completed" if r.stdout == b"ok\n" else "failed:bad-output"] += 1
    except libdsec.SandboxNotFound as exc:
        outcomes[f"failed:{exc.reason}"] += 1
        return
    except libdsec.DsecError as exc:
        outcomes[f"failed:{exc.code}"] += 1
        if VERBOSE:
            print(f"  {exc.code}: {exc}", file=sys.stderr)
        return
    try:
        await sb.destroy()    # its outcome is counted already; a node_lost here is the edge's crash
    except libdsec.DsecError:
        pass


async def scenario(creates: int, tmp: Path) -> int:
    """Returns the process exit code (0 on PASS)."""
    from cli.stack import Stack
    from edge.backends.registry import node_leftovers as leftovers
    from bus import iam
    identities = iam.bootstrap(tmp / "iam", nodes=[NODE])   # before the server starts
    srv = NatsServer(tmp / "nats", port=free_port(), iam=identities).start()
    placement = Stack(tmp / "placement", nats_url=srv.url, metrics_port=None, run_edge=False,
                      creds=str(identities.creds_path("placement")))
    await placement.start()
    edge_creds = str(identities.creds_path(f"edge-{NODE}"))
    edge = start_edge(srv.url, tmp / "edge", edge_creds)
    outcomes: collections.Counter = collections.Counter()
    after: collections.Counter = collections.Counter()   # creates after the restart: all must be served
    ids: list[str] = []
    try:
        async with libdsec.AsyncClient(srv.url, creds=str(identities.creds_path("tenant:default"))) as client:
            tasks = [asyncio.create_task(one(client, outcomes, ids)) for _ in range(creates)]
            while len(ids) < max(1, creates // 4):   # mid-burst: some sandboxes run, more are coming
                await asyncio.sleep(0.01)
            edge.send_signal(signal.SIGKILL)
            edge.wait()
            await asyncio.sleep(1.0)
            edge = start_edge(srv.url, tmp / "edge", edge_creds)
            await asyncio.gather(*(one(client, after, []) for _ in range(4)))
            await asyncio.wait(tasks, timeout=90)
            lost = sum(1 for t in tasks if not t.done())
            records = [sandbox_decoder.decode(v) for _, v in await placement.bus.kv_items(streams.SANDBOXES_KV)]
            ready = [r.sandbox_id for r in records if r.state == "ready"]
            for sid in ready:                     # clean up what survived
                try:
                    await (await client.get(sid)).destroy()
                except libdsec.DsecError:
                    pass
        duplicated = len(ids) - len(set(ids))
    finally:
        edge.send_signal(signal.SIGTERM)
        edge.wait(20)
        await placement.stop()
        srv.stop()
    leaked = len(leftovers(tmp / "edge" / "edge", NODE))
    failed = {k.split(":", 1)[1]: v for k, v in outcomes.items() if k.startswith("failed:")}
    untyped = sum(v for k, v in failed.items() if k not in TYPED_FAILURES)
    ok = (lost == 0 and duplicated == 0 and leaked == 0 and untyped == 0 and after["completed"] == 4
          and outcomes["completed"] + sum(failed.values()) == creates)
    print(f"verdict: submitted={creates} completed={outcomes['completed']} failed={sum(failed.values())} "
          f"({', '.join(f'{k}={v}' for k, v in sorted(failed.items())) or 'none'}) lost={lost} "
          f"duplicated={duplicated} leaked={leaked} served_after_restart={after['completed']}/4 "
          f"-> {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def main() -> None:
    """Parse arguments and run the scenario in a temp dir."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--creates", type=int, default=40, help="creates in the burst (default 40)")
    ap.add_argument("-v", action="store_true", help="print each failure's message")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dsec-chaos-") as tmp:
        raise SystemExit(asyncio.run(scenario(args.creates, Path(tmp))))


if __name__ == "__main__":
    main()
