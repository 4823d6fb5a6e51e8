"""Execs an edge left running when it died (SIGKILL, a crash): each exec's start is journaled, a file per exec
under the edge's state dir (its request without stdin, and when it started), removed once its exit and
trajectory records are out. The next run of the edge closes what is left before it reports the sandbox
node_lost: the exit record (when none is stored) after the output stored before the crash, and the
trajectory record summing that output. A crash erased running commands from the episode before: no
trajectory record, and a background exec's output never got its exit record (helper V)."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Callable

import msgspec

from bus import subjects
from bus.conn import Bus
from bus.errors import SandboxNotFound
from bus.execwire import ExitRecord, decode_output
from bus.messages import ExecRequest
from bus.records import SandboxRecord
from bus.streams import OUT_STREAM
from chronus.relay import OutputRelay

log = logging.getLogger(__name__)

EXIT_FIELDS = ("exit_code", "duration", "timed_out", "cpu_time", "peak_memory", "error_code", "error", "reason",
               "failure_class", "fault")


class Left(msgspec.Struct, frozen=True):
    """A journaled exec: its request (stdin left out) and when it started."""

    op: ExecRequest
    started: float


_decoder = msgspec.json.Decoder(Left)
_encoder = msgspec.json.Encoder()


class ExecJournal:
    """The running execs of one edge, a file each under root (named by the exec id: a subject token)."""

    def __init__(self, root: Path, stamp: Path) -> None:
        self.root = root
        self.stamp = stamp   # the file the edge touches while it runs (edge/fence.py): when a dead run was last
        root.mkdir(parents=True, exist_ok=True)   # seen alive, so its execs' durations end there

    def last_alive(self) -> float:
        """When the run that left the journal's entries was last seen alive (0: never stamped). Read before
        this run stamps it (the edge starts its fence after it closed what a dead run left)."""
        try:
            return self.stamp.stat().st_mtime
        except OSError:
            return 0.0

    def begin(self, op: ExecRequest, started: float) -> None:
        """Journal an exec that starts (best effort: a full disk costs only its record after a crash). What its
        trajectory record keeps, and no more: no stdin, its env's names without their values; owner-only."""
        kept = msgspec.structs.replace(op, stdin=b"", env=dict.fromkeys(op.env, ""))
        try:
            fd = os.open(self.root / op.exec_id, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(_encoder.encode(Left(kept, started)))
        except OSError as exc:
            log.warning("exec %s not journaled: %s", op.exec_id, exc)

    def end(self, exec_id: str) -> None:
        """Its exit and trajectory records are out."""
        try:
            os.unlink(self.root / exec_id)
        except OSError:
            pass

    def left(self) -> list[Left]:
        """What a run that died left (read at start; junk is dropped)."""
        found = []
        for path in sorted(self.root.iterdir()):
            try:
                found.append(_decoder.decode(path.read_bytes()))
            except (OSError, msgspec.DecodeError, msgspec.ValidationError):
                log.warning("dropped an unreadable exec journal entry %s", path.name)
                path.unlink(missing_ok=True)
        return found


Trajectory = Callable[[ExecRequest, OutputRelay, dict, SandboxRecord, float, float | None],
                      list[tuple[str, bytes, str]]]


async def close(bus: Bus, node: str, left: Left, lost_at: float, rec: SandboxRecord, max_output: int,
                traj_output: int, trajectory: Trajectory) -> list[tuple[str, bytes, str]]:
    """End an exec a dead run of this node left: its exit record stored (after what it printed; unless one
    is), and its trajectory record's messages (the caller puts them on the sandbox's timeline). It ended
    when its run was last seen alive (`lost_at`, within a second), not when the next run closes it; the
    platform's failure, not the task's: failure_class `environment`."""
    op = left.op
    subject = subjects.output(op.tenant, node, op.sandbox_id, op.exec_id)
    relay = OutputRelay(bus, subject, op.exec_id, max_output, traj_output)
    ended: ExitRecord | None = None
    seq = 0
    while (stored := await bus.stored_after(OUT_STREAM, subject, seq)) is not None:   # (message gets: an edge
        seq = stored.seq                                                               # makes no consumer there)
        try:
            rec_ = decode_output(stored.data, stored.headers)
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        if isinstance(rec_, ExitRecord):
            ended = rec_
        else:
            relay.stored_before(rec_)
    end_at = max(left.started, min(lost_at, time.time()))
    if ended is None:
        err = SandboxNotFound(f"sandbox {op.sandbox_id} was lost while the command ran: its node's edge stopped",
                              reason="node_lost")
        ended = await relay.finish(exit_code=-1, duration=end_at - left.started, error_code=err.code,
                                   error=str(err), reason="node_lost", failure_class="environment",
                                   fault=f"node {node}'s edge stopped at ~{time.strftime('%H:%M:%S', time.gmtime(end_at))}"
                                         " UTC while the command ran")
    relay.truncated = ended.truncated
    return trajectory(op, relay, {f: getattr(ended, f) for f in EXIT_FIELDS}, rec, left.started,
                      left.started + ended.duration)
