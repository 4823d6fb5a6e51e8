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
The 8 s are of the fence's own steady watch (monotonic), begun again after a gap in its looks: a stack
stopped as a whole (Ctrl-Z of `dsec up`, a suspended host) is not fenced when it runs again. It shares the
edge's process group and ignores SIGINT (Ctrl-C reaches the whole group: the edge stops, then the fence
finds it gone); the edge ends it with SIGTERM when it stops, and starts it again if it died. `python -m edge.fence --pid PID --stamp FILE --node NODE`."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
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
TICK = 0.25          # seconds between two stamps of the edge's
GAP = 2.0            # seconds between two looks of the fence's that mean it did not run itself meanwhile
KINDS = ("", ".fn", ".gvisor", ".microvm", ".fullvm")   # the cgroup labels of a node's backends
ENABLED = True       # False in a process whose loop does not always run (the test suite's in-process edges: its
                     # loop sits idle between tests; edges it starts as processes are fenced)

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


def stamp_of(state_dir: Path) -> Path:
    """The file an edge touches while it runs (its fence watches it; its exec journal reads it after a crash:
    when the dead run was last seen alive)."""
    return state_dir / "alive"


def mark_of(stamp: Path) -> Path:
    """The file the fence leaves when it ended the sandboxes of a stalled edge."""
    return stamp.with_name(stamp.name + ".fenced")


def _mtime(stamp: Path) -> float:
    try:
        return stamp.stat().st_mtime
    except OSError:
        return 0.0


def watch(pid: int, stamp: Path, node: str, after: float = FENCE_AFTER) -> None:
    """Until the edge is gone: fence when its stamp has not moved for `after` seconds of the fence's own
    steady watch (monotonic, and begun again after a gap in it: a stack stopped as a whole, Ctrl-Z, a
    suspended host, is not an edge that stopped alone); fence once more when it is gone."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        fd = None
    poller = select.poll()
    if fd is not None:
        poller.register(fd, select.POLLIN)
    seen, moved, looked, fenced = _mtime(stamp), time.monotonic(), time.monotonic(), False
    while fd is not None and not poller.poll(LOOK_EVERY * 1000):
        now, mtime = time.monotonic(), _mtime(stamp)
        if mtime != seen or now - looked > GAP:   # it ran, or we did not look (stopped with it): watch afresh
            seen, moved, fenced = mtime, now, False
        looked = now
        if now - moved > after and not fenced:
            log.error("edge %s (pid %d) has not run for %.1f s: ending node %s's sandboxes before it is declared "
                      "lost", node, pid, now - moved, node)
            ok = asyncio.run(kill_all(node))
            try:
                mark_of(stamp).write_text(f"{time.time()}\n")
            except OSError as exc:
                log.error("fence mark not written (%s): node %s's edge will not know", exc, node)
            fenced, looked = True, time.monotonic()   # (its own kill is no gap in its watch)
            if not ok:
                log.error("some processes of node %s's sandboxes survived the fence", node)
    if not asyncio.run(kill_all(node)):   # the edge is gone: nothing may run on unanswered for
        log.error("some processes of node %s's sandboxes survived the fence", node)


class EdgeFence:
    """The edge's side: the fence process started beside it, the stamp it touches, the mark it looks for."""

    def __init__(self, node: str, state_dir: Path) -> None:
        self.node = node
        self.stamp = stamp_of(state_dir)
        self.proc: subprocess.Popen | None = None
        self._ticked = 0.0

    def start(self) -> None:
        """Stamp, and start the fence (a mark a dead run left is dropped: its sandboxes were reconciled)."""
        mark_of(self.stamp).unlink(missing_ok=True)
        self.touch()
        if not ENABLED or os.environ.get("DSEC_FENCE", "1") == "0":   # (an operator's: docs/durability.md)
            return
        self._spawn()

    def _spawn(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "edge.fence", "--pid", str(os.getpid()),
                                      "--stamp", str(self.stamp), "--node", self.node],
                                     stdin=subprocess.DEVNULL, close_fds=True)

    def touch(self) -> None:
        try:
            os.utime(self.stamp)
        except FileNotFoundError:
            with contextlib.suppress(OSError):
                self.stamp.touch()
        except OSError:   # (a read-only state dir: its fence ends its sandboxes, as it must)
            pass

    def tick(self) -> bool:
        """The edge runs (its TTL loop, up to every 5 ms: the work is done every TICK): the stamp touched, a
        fence that died started again (said in the log); True once when the fence ended the sandboxes while
        this edge did not run (the mark is taken)."""
        now = time.monotonic()
        if now - self._ticked < TICK:
            return False
        self._ticked = now
        self.touch()
        if self.proc is not None and self.proc.poll() is not None:
            log.error("the fence of node %s exited (%s): starting it again", self.node, self.proc.returncode)
            self._spawn()
        return self._fenced()

    def marked(self) -> bool:
        """Whether the fence ended the sandboxes and the edge has not answered it yet."""
        return mark_of(self.stamp).exists()

    def _fenced(self) -> bool:
        """Whether the fence ended the sandboxes while this edge did not run (once: the mark is taken)."""
        mark = mark_of(self.stamp)
        if not mark.exists():
            return False
        mark.unlink(missing_ok=True)
        return True

    async def stop(self) -> None:
        """End the fence first: a stopping edge ends its sandboxes itself."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                await asyncio.to_thread(proc.wait, 5)
            except subprocess.TimeoutExpired:   # (stopped itself: SIGSTOP)
                proc.kill()
                await asyncio.to_thread(proc.wait)


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
