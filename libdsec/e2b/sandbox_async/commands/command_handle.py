"""AsyncCommandHandle: a command started with background=True."""
from __future__ import annotations

import asyncio
import codecs
import collections
import inspect
import signal
from typing import Any, Callable, Optional

from bus.errors import DsecError
from bus.errors import SandboxNotFound
from libdsec.e2b.exceptions import SandboxException, TimeoutException, mapped
from libdsec.e2b.sandbox.commands.command_handle import CommandExitException, CommandResult
from libdsec.exechandle import ExecHandle
from libdsec.results import Exit, Output

OutputHandler = Callable[[str], Any]
TIMED_OUT = "timed out"
MAX_OUTPUT = 64 << 20   # bytes of a command's output kept (the edge's cap by default); the rest is dropped, said in
TRUNCATED = f"output past {MAX_OUTPUT >> 20} MiB was dropped (the node's cap per command)"   # the result's error
END = object()   # the end of a handle's events
KILLED = "signal: killed"   # E2B's result of a command it killed (exit code -1), as its envd says it
_killed: collections.OrderedDict[tuple[str, int], None] = collections.OrderedDict()   # (sandbox, pid) killed here
REMEMBERED_KILLS = 10_000


async def killed_here(sandbox_id: str, pid: int, kill) -> bool:
    """Kill a command of this process's facade (commands.kill, a handle's or a terminal's kill: `kill` does it)
    so that its result says so as E2B's does (exit code -1, error "signal: killed"), not as the shell's 137.
    Marked before the kill (its exit may come before the kill's answer); a kill that found nothing unmarks it."""
    key = (sandbox_id, pid)
    _killed[key] = None
    while len(_killed) > REMEMBERED_KILLS:
        _killed.popitem(last=False)
    done = False
    try:
        done = await kill()
        return done
    finally:
        if not done:
            _killed.pop(key, None)


def _error(ev: Exit, killed: bool) -> Optional[str]:
    """The result's error as E2B's envd words it ("exit status 3", "signal: killed"), or DSec's own cases."""
    if ev.timed_out:
        return TIMED_OUT
    if killed:
        return KILLED
    said = f"exit status {ev.exit_code}" if ev.exit_code else None
    return f"{said}; {TRUNCATED}" if said and ev.truncated else said or (TRUNCATED if ev.truncated else None)


async def call_handler(fn: Optional[Callable[..., Any]], *args: Any) -> None:
    """Call a user's handler (on_stdout, on_event, ...), awaiting it when it is a coroutine function."""
    if fn is not None:
        result = fn(*args)
        if inspect.isawaitable(result):
            await result


async def started_or_closed(handle: ExecHandle) -> int:
    """The exec's pid once it started; one that never did raises why, its handle closed."""
    try:
        return await handle.started()
    except BaseException:
        await handle.close()
        raise


def _retrieved(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


class AsyncCommandHandle:
    """A running command: wait() for its result, kill() it. Output goes to the handlers as it arrives
    (chunks: a line not finished yet too) and is kept for the result. pid: its pid in the sandbox."""

    def __init__(self, handle: ExecHandle, on_stdout: Optional[OutputHandler] = None,
                 on_stderr: Optional[OutputHandler] = None, on_pty: Optional[Callable[[bytes], Any]] = None,
                 pty: bool = False) -> None:
        self._handle = handle
        self.pid: int = handle.pid
        self._pty = pty or on_pty is not None   # a terminal's: its output is bytes for on_pty, not text
        self._on_pty = on_pty
        self._pty_held: list[bytes] = []        # what came while no on_pty was given (wait(on_pty) gets it)
        self._stdout: list[str] = []
        self._stderr: list[str] = []
        self._on = {"stdout": on_stdout, "stderr": on_stderr}
        # a chunk may end inside a UTF-8 character: each stream decodes on across its chunks
        self._decoders = {name: codecs.getincrementaldecoder("utf-8")(errors="replace") for name in self._on}
        self._result: Optional[CommandResult] = None
        self.events: asyncio.Queue = asyncio.Queue()   # (stdout, stderr, pty) per chunk, then END (iteration)
        self._pump = asyncio.ensure_future(self._read())
        self._pump.add_done_callback(_retrieved)   # (a handle nobody waits on: no "exception never retrieved")

    @property
    def stdout(self) -> str:
        """What it printed to stdout so far."""
        return "".join(self._stdout)

    @property
    def stderr(self) -> str:
        """What it printed to stderr so far."""
        return "".join(self._stderr)

    @property
    def exit_code(self) -> Optional[int]:
        """Its exit code once it ended, else None (-1 when it was killed, as E2B says it)."""
        return self._result.exit_code if self._result else None

    @property
    def error(self) -> Optional[str]:
        """Once it ended: why it failed ("exit status 3", "signal: killed"), else None."""
        return self._result.error if self._result else None

    async def _text(self, stream: str, text: str) -> None:
        """Text of a stream to its result, events and handler; none for a chunk that only began a character
        (E2B's handlers get no empty text), and the end of a cut character at the exit (helper U2: it reached
        the result, never the handler)."""
        if not text:
            return
        (self._stdout if stream == "stdout" else self._stderr).append(text)
        self.events.put_nowait((text, None, None) if stream == "stdout" else (None, text, None))
        await call_handler(self._on[stream], text)

    async def _read(self) -> CommandResult:
        try:
            async for ev in self._handle.stream(lines=False):
                if isinstance(ev, Output) and self._pty:
                    self.events.put_nowait((None, None, ev.data))
                    if self._on_pty is None:
                        self._pty_held.append(ev.data)
                    else:
                        await call_handler(self._on_pty, ev.data)
                elif isinstance(ev, Output):
                    await self._text(ev.stream, self._decoders[ev.stream].decode(ev.data))
                elif isinstance(ev, Exit):
                    for name, decoder in self._decoders.items():   # a cut character at the very end
                        await self._text(name, decoder.decode(b"", final=True))
                    marked = _killed.pop((self._handle.sandbox_id, self.pid), False) is None   # (looked at once)
                    killed = marked and ev.exit_code == 128 + signal.SIGKILL
                    self._result = CommandResult(stderr=self.stderr, stdout=self.stdout,
                                                 exit_code=-1 if killed else ev.exit_code, error=_error(ev, killed))
        except SandboxNotFound as err:   # as E2B says it: the command's connection timed out, the sandbox gone
            exc = TimeoutException(f"{err}: the sandbox was killed or reached its end of life")
            self.events.put_nowait(exc)
            raise exc from err
        except DsecError as err:
            self.events.put_nowait(mapped(err))
            raise mapped(err) from err
        finally:
            await self._handle.close()
            self.events.put_nowait(END)
        if self._result is None:
            self._result = CommandResult(stderr=self.stderr, stdout=self.stdout, exit_code=-1,
                                         error="the command's output ended without its exit")
        return self._result

    async def wait(self, on_stdout: Optional[OutputHandler] = None, on_stderr: Optional[OutputHandler] = None,
                   on_pty: Optional[Callable[[bytes], Any]] = None) -> CommandResult:
        """Wait for the end; CommandExitException when the exit code is not 0. Handlers given here get
        what arrives from now on."""
        if on_stdout is not None:
            self._on["stdout"] = on_stdout
        if on_stderr is not None:
            self._on["stderr"] = on_stderr
        if on_pty is not None:
            held, self._pty_held = self._pty_held, []
            for data in held:
                await call_handler(on_pty, data)
            self._on_pty = on_pty
        try:
            result = await asyncio.shield(self._pump)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._pump.cancelled() and not (task is not None and task.cancelling()):
                raise SandboxException("this handle was disconnected from the command (it may still run): "
                                       "commands.connect(pid) reads it again") from None
            raise
        if result.error == TIMED_OUT:
            raise TimeoutException(f"the command timed out (its process tree was killed); output so far: "
                                   f"{result.stdout[-200:]!r}")
        if result.exit_code != 0:
            raise CommandExitException(stderr=result.stderr, stdout=result.stdout, exit_code=result.exit_code,
                                       error=result.error)
        return result

    async def kill(self) -> bool:
        """Kill its whole process tree; False when it had already ended."""
        try:
            return await killed_here(self._handle.sandbox_id, self.pid, self._handle.kill)
        except DsecError as err:
            raise mapped(err) from err

    async def send_stdin(self, data) -> None:
        """Write data (str or bytes) to its stdin (started with stdin=True)."""
        try:
            if not await self._handle.send_stdin(data):
                raise SandboxException("the command ended or closed its stdin")
        except DsecError as err:
            raise mapped(err) from err

    async def close_stdin(self) -> None:
        """End its stdin (it reads EOF)."""
        try:
            await self._handle.close_stdin()
        except DsecError as err:
            raise mapped(err) from err

    async def disconnect(self) -> None:
        """Stop reading its output here (it keeps running; its output stays in the trajectory)."""
        self._pump.cancel()
