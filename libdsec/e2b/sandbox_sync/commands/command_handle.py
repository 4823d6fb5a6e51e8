"""CommandHandle: the synchronous AsyncCommandHandle."""
from __future__ import annotations

from typing import Callable, Optional

from libdsec.e2b.sandbox.commands.command_handle import CommandResult
from libdsec.e2b.sandbox_async.commands.command_handle import AsyncCommandHandle


class CommandHandle:
    """A running command: wait() for its result, kill() it (see AsyncCommandHandle)."""

    def __init__(self, run, inner: AsyncCommandHandle) -> None:
        self._run = run
        self._inner = inner
        self.pid = inner.pid

    @property
    def stdout(self) -> str:
        return self._inner.stdout

    @property
    def stderr(self) -> str:
        return self._inner.stderr

    @property
    def exit_code(self) -> Optional[int]:
        return self._inner.exit_code

    def wait(self, on_stdout: Optional[Callable[[str], None]] = None,
             on_stderr: Optional[Callable[[str], None]] = None,
             on_pty: Optional[Callable[[bytes], None]] = None) -> CommandResult:
        """Wait for the end; CommandExitException when the exit code is not 0. A terminal's output goes to
        on_pty as bytes (from the start, what came before too)."""
        return self._run(self._inner.wait(on_stdout, on_stderr, on_pty))

    def kill(self) -> bool:
        """Kill its whole process tree; False when it had already ended."""
        return self._run(self._inner.kill())

    def send_stdin(self, data) -> None:
        """Write data to its stdin (started with stdin=True)."""
        self._run(self._inner.send_stdin(data))

    def close_stdin(self) -> None:
        """End its stdin."""
        self._run(self._inner.close_stdin())

    def disconnect(self) -> None:
        """Stop reading its output here (it keeps running)."""
        self._run(self._inner.disconnect())
