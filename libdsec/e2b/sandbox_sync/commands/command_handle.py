"""CommandHandle: the synchronous AsyncCommandHandle."""
from __future__ import annotations

from typing import Callable, Iterator, Optional, Tuple

from libdsec.e2b.sandbox.commands.command_handle import CommandResult
from libdsec.e2b.exceptions import TimeoutException
from libdsec.e2b.sandbox_async.commands.command_handle import END, TIMED_OUT, AsyncCommandHandle


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

    def __iter__(self) -> Iterator[Tuple[Optional[str], Optional[str], Optional[bytes]]]:
        """(stdout, stderr, pty) per chunk as it arrives, one of them set; at the end TimeoutException if it
        timed out (a non-zero exit ends the iteration: wait() tells it)."""
        while True:
            item = self._run(self._inner.events.get())
            if item is END:
                result = self._inner._result
                if result is not None and result.error == TIMED_OUT:
                    raise TimeoutException("the command timed out (its process tree was killed)")
                return
            if isinstance(item, BaseException):
                raise item
            yield item

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
