"""What execs give back: Output events, the Exit record, and the collected ExecResult."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Output:
    """One line (or the last partial line) of one stream, as it arrived."""

    stream: Literal["stdout", "stderr"]
    data: bytes


@dataclass(frozen=True)
class Exit:
    """The end of an exec."""

    exit_code: int
    duration: float
    cpu_time: float = 0.0
    peak_memory: int = 0
    timed_out: bool = False
    truncated: bool = False
    exec_id: str = ""           # its output is on dsec.out.<tenant>.<node>.<sandbox>.<exec_id>, its record in the trajectory
    pid: int = 0                # its pid in the sandbox (0: it never started, or its kind does not say)
    failure_class: str = ""     # "environment": it failed while the node failed under it (fault says how), not
    fault: str = ""             # by its own doing: retry it, in a fresh sandbox (another node); "task" with a fault:
                                # its own doing that the exit code alone hides ("out of memory: ..."); "" otherwise


@dataclass(frozen=True)
class ExecResult:
    """A finished exec: its exit and everything it printed (bytes)."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    duration: float
    cpu_time: float = 0.0
    peak_memory: int = 0
    timed_out: bool = False
    truncated: bool = False
    exec_id: str = ""
    pid: int = 0
    failure_class: str = ""     # as Exit's: "environment" when the node failed under the command
    fault: str = ""

    @property
    def ok(self) -> bool:
        """Exit code 0."""
        return self.exit_code == 0
