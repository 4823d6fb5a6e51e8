"""CommandHandle: the synchronous AsyncCommandHandle."""
from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Iterator, Optional, Tuple

from libdsec.e2b.sandbox.commands.command_handle import CommandResult
from libdsec.e2b.exceptions import TimeoutException
from libdsec.e2b.sandbox_async.commands.command_handle import END, TIMED_OUT, AsyncCommandHandle

log = logging.getLogger(__name__)


class HandlerThread:
    """A background command's handlers given to run(): called in a thread of their own as its output comes,
    in order (not on the facade's loop thread, which a handler calling the sandbox would wait on for ever);
    the thread ends with the command's output."""

    def __init__(self, on_stdout: Optional[Callable[[str], None]], on_stderr: Optional[Callable[[str], None]]) -> None:
        self._on = {"stdout": on_stdout, "stderr": on_stderr}
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._serve, name="e2b-handlers", daemon=True).start()

    def handler(self, stream: str) -> Optional[Callable[[str], None]]:
        """The handler this thread calls for stream's chunks."""
        return self._on[stream]

    def stdout(self, text: str) -> None:
        self._queue.put(("stdout", text))

    def stderr(self, text: str) -> None:
        self._queue.put(("stderr", text))

    async def started(self, start) -> AsyncCommandHandle:
        """start's handle, this thread ended once its output has (or at once if it never started)."""
        try:
            h = await start
        except BaseException:
            self._queue.put(None)
            raise
        h._pump.add_done_callback(lambda _: self._queue.put(None))
        return h

    def join(self) -> None:
        """Every chunk so far handled (not from a handler itself: that would wait on its own call)."""
        if threading.current_thread().name != "e2b-handlers":
            self._queue.join()

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                fn = self._on[item[0]]
                if fn is not None:
                    fn(item[1])
            except Exception:
                log.exception("an output handler of a background command raised")
            finally:
                self._queue.task_done()


class CommandHandle:
    """A running command: wait() for its result, kill() it (see AsyncCommandHandle). As E2B's, its output
    handlers run in the caller's thread, inside wait(): a handler may call the sandbox (a handler run on
    the facade's loop thread and calling it would wait on that thread for ever)."""

    def __init__(self, run, inner: AsyncCommandHandle, on_stdout: Optional[Callable[[str], None]] = None,
                 on_stderr: Optional[Callable[[str], None]] = None, calls: Optional[HandlerThread] = None) -> None:
        self._run = run
        self._inner = inner
        self._calls = calls   # run(background=True)'s handlers, called as the output comes
        self._on_stdout, self._on_stderr = on_stdout, on_stderr   # (run()'s: wait()'s own come first)
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

    @property
    def error(self) -> Optional[str]:
        return self._inner.error

    def __iter__(self) -> Iterator[Tuple[Optional[str], Optional[str], Optional[bytes]]]:
        """(stdout, stderr, pty) per chunk as it arrives, one of them set; at the end TimeoutException if it
        timed out (a non-zero exit ends the iteration: wait() tells it)."""
        while True:
            item = self._run(self._inner.events.get())
            if item is END:
                self._inner.events.put_nowait(END)   # (wait() after the iteration ends at once)
                result = self._inner._result
                if result is not None and result.error == TIMED_OUT:
                    raise TimeoutException("the command timed out (its process tree was killed)")
                return
            if isinstance(item, BaseException):
                self._inner.events.put_nowait(END)
                raise item
            yield item

    def wait(self, on_pty: Optional[Callable[[bytes], None]] = None,
             on_stdout: Optional[Callable[[str], None]] = None,
             on_stderr: Optional[Callable[[str], None]] = None) -> CommandResult:
        """Wait for the end, calling the handlers (E2B's order: on_pty, on_stdout, on_stderr; run()'s when
        not given here) here with each chunk still to come; CommandExitException when the exit code is not 0."""
        on_stdout, on_stderr = on_stdout or self._on_stdout, on_stderr or self._on_stderr
        if self._calls is not None:
            # run()'s own handlers, given here again, are not called twice a chunk: E2B's sync run ignores a
            # background command's, so code written for it passes them to both (they came twice: helper-41)
            on_stdout = None if on_stdout == self._calls.handler("stdout") else on_stdout
            on_stderr = None if on_stderr == self._calls.handler("stderr") else on_stderr
        chunks = iter(self)
        while True:
            try:
                out, err, pty = next(chunks)
            except StopIteration:
                break
            except Exception:   # the reading's own end (a timeout, the sandbox gone): wait() below says it
                break
            if out is not None and on_stdout is not None:   # (a handler's exception is the caller's: raised)
                on_stdout(out)
            elif err is not None and on_stderr is not None:
                on_stderr(err)
            elif pty is not None and on_pty is not None:
                on_pty(pty)
        if self._calls is not None:
            self._calls.join()
        return self._run(self._inner.wait())

    def kill(self) -> bool:
        """Kill its whole process tree; False when it had already ended."""
        return self._run(self._inner.kill())

    def send_stdin(self, data, request_timeout: Optional[float] = None) -> None:
        """Write data to its stdin (started with stdin=True)."""
        self._run(self._inner.send_stdin(data))

    def close_stdin(self, request_timeout: Optional[float] = None) -> None:
        """End its stdin."""
        self._run(self._inner.close_stdin())

    def disconnect(self) -> None:
        """Stop reading its output here (it keeps running)."""
        self._run(self._inner.disconnect())
