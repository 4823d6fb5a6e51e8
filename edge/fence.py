"""The node's fence: a small process beside the edge that ends the node's sandboxes when the edge can no
longer answer for them, so nothing runs on after its users were told `node_lost` (helper N: an edge stopped
with SIGSTOP for 90 s had its commands run on for the whole pause, 80 s past the node_lost their users got
at 10 s and while they ran the work again elsewhere; an edge SIGKILLed and never started again left its
sandboxes running past their TTLs and their commands past their timeouts, for ever).

The edge touches a stamp file every half second (its TTL loop). The fence kills every process of the
node's sandbox groups (every kind's freezer trees: containers, gVisor, VMs, FnCall workers)
- when the edge process is gone (SIGKILL, a crash): at once; its next start reconciles the rest and reports
  the sandboxes node_lost, as it did;
- when the stamp is older than FENCE_AFTER (the edge stopped, or its loop blocked): 2 s before placement
  declares the node lost (NODE_LOST_AFTER without a heartbeat, which comes from the same loop). It then
  leaves a mark file; the edge, running again, finds it and ends its sandboxes as node_lost, as it does when
  it learns it was declared lost.
It shares the edge's process group (Ctrl-Z of `dsec up` stops both: no fence for a stack paused as a whole)
and ignores SIGINT (Ctrl-C reaches the whole group: the edge stops, then the fence finds it gone); the edge
ends it with SIGTERM when it stops. `python -m edge.fence --pid PID --stamp FILE --node NODE`."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from bus import streams
from edge.backends import cgroups

FENCE_AFTER = streams.NODE_LOST_AFTER - 2.0   # seconds of a stale stamp before the sandboxes are ended
LOOK_EVERY = 0.5
KINDS = ("", ".fn", ".gvisor", ".microvm", ".fullvm")   # the cgroup labels of a node's backends

log = logging.getLogger("dsec.fence")


def freezers(node: str) -> list[Path]:
    """The freezer roots of every backend's sandbox groups of node."""
    return [tree["freezer"] for kind in KINDS for tree in cgroups.NodeCgroups(f"{node}{kind}").trees]


async def kill_all(node: str) -> bool:
    """Kill every process in the node's sandbox groups; False when some survive (bounded)."""
    done = True
    for root in freezers(node):
        if root.exists():
            done = await cgroups.kill_tree(root) and done
    return done


def mark_of(stamp: Path) -> Path:
    """The file the fence leaves when it ended the sandboxes of a stalled edge."""
    return stamp.with_name(stamp.name + ".fenced")


def _age(stamp: Path) -> float:
    try:
        return time.time() - stamp.stat().st_mtime
    except OSError:
        return 0.0   # (no stamp yet: the edge is starting)


def watch(pid: int, stamp: Path, node: str, after: float = FENCE_AFTER) -> None:
    """Until the edge is gone: fence when its stamp goes stale; fence once more when it is gone."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        fd = None
    poller = select.poll()
    if fd is not None:
        poller.register(fd, select.POLLIN)
    fenced = False
    while fd is not None and not poller.poll(LOOK_EVERY * 1000):
        stale = _age(stamp)
        if stale > after and not fenced:
            log.error("edge %s (pid %d) has not run for %.1f s: ending node %s's sandboxes before it is declared "
                      "lost", node, pid, stale, node)
            ok = asyncio.run(kill_all(node))
            mark_of(stamp).write_text(f"{time.time()}\n")
            fenced = True
            if not ok:
                log.error("some processes of node %s's sandboxes survived the fence", node)
        elif stale < after:
            fenced = False
    if not asyncio.run(kill_all(node)):   # the edge is gone: nothing may run on unanswered for
        log.error("some processes of node %s's sandboxes survived the fence", node)


class EdgeFence:
    """The edge's side: the fence process started beside it, the stamp it touches, the mark it looks for."""

    def __init__(self, node: str, state_dir: Path) -> None:
        self.node = node
        self.stamp = state_dir / "alive"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        """Stamp, and start the fence (a mark a dead run left is dropped: its sandboxes were reconciled)."""
        mark_of(self.stamp).unlink(missing_ok=True)
        self.touch()
        if os.environ.get("DSEC_FENCE", "1") == "0":   # (an operator's choice: documented in docs/durability.md)
            return
        self.proc = subprocess.Popen([sys.executable, "-m", "edge.fence", "--pid", str(os.getpid()),
                                      "--stamp", str(self.stamp), "--node", self.node],
                                     stdin=subprocess.DEVNULL, close_fds=True)

    def touch(self) -> None:
        try:
            os.utime(self.stamp) if self.stamp.exists() else self.stamp.touch()
        except OSError:
            pass

    def fenced(self) -> bool:
        """Whether the fence ended the sandboxes while this edge did not run (once: the mark is taken)."""
        mark = mark_of(self.stamp)
        if not mark.exists():
            return False
        mark.unlink(missing_ok=True)
        return True

    async def stop(self) -> None:
        """End the fence first: a stopping edge ends its sandboxes itself."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            await asyncio.to_thread(self.proc.wait)
        self.proc = None


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m edge.fence", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pid", type=int, required=True, help="the edge's process")
    parser.add_argument("--stamp", type=Path, required=True, help="the file the edge touches while it runs")
    parser.add_argument("--node", required=True, help="the node whose sandboxes are ended")
    parser.add_argument("--after", type=float, default=FENCE_AFTER, help="seconds of a stale stamp")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch(args.pid, args.stamp, args.node, args.after)


if __name__ == "__main__":
    main()
