"""What a command gives back, as in E2B: CommandResult and CommandExitException."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from libdsec.e2b.exceptions import SandboxException

Stdout = str
Stderr = str
PtyOutput = bytes


@dataclass
class PtySize:
    """A terminal's size."""

    rows: int
    cols: int


@dataclass
class CommandResult:
    """A finished command: its output (decoded as UTF-8, bad bytes replaced) and exit code."""

    stderr: str
    stdout: str
    exit_code: int
    error: Optional[str]


@dataclass
class CommandExitException(SandboxException, CommandResult):
    """A command exited with a non-zero code (wait() and a foreground run() raise it)."""

    def __str__(self) -> str:
        return f"Command exited with code {self.exit_code} and error:\n{self.stderr}"
