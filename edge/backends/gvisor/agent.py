"""The edge's side of dsec-agent (native/dsec-agent.c), the pid 1 of every gVisor sandbox: one framed
channel over the container's stdio (two host pipes the sentry hands the agent as fds 0 and 1), many
execs multiplexed on it. Frame: u32 length of the rest, u8 type, u32 exec id, payload (little-endian).

Output is flow-controlled: the agent stops reading an exec's pipes once WINDOW bytes of its output are
unconsumed; the edge grants credit back as the sink takes chunks, so a slow sink slows only its exec.
"""
from __future__ import annotations

import asyncio
import os
import signal
import struct
import time
from dataclasses import dataclass, field

from edge.backends import execio
from edge.backends.base import BackendError, CommandNotStarted, ExecControl, ExecResult, OutputSink, SandboxGone

HEAD = struct.Struct("<IBI")
WINDOW = 1 << 20            # must match dsec-agent.c: unconsumed output bytes per exec
GRANT_EVERY = 256 << 10     # credit is given back in steps this big (well under WINDOW: no stall)
STDIN_CHUNK = 64 << 10
KILL_GRACE = 5.0
WITH_USER = 1 << 31        # an exec request's argc flag: a user "UID:GID[:GROUP...]" follows its cwd
WITH_TTY = 1 << 30         # and "ROWS COLS" follows (after the user): it runs on a terminal of that size
WITH_END = 1 << 29         # it ends with its command (ExecRequest.end_on_exit)


@dataclass
class _Exec:
    """One exec's side of the channel: its output queue, stdin acks, how it ended."""

    queue: asyncio.Queue = field(default_factory=asyncio.Queue)   # (stream, bytes) | ("exit", ...) items
    acks: list[asyncio.Future] = field(default_factory=list)      # one per stdin frame sent, in order
    failure: bytes = b""
    running: bool = True


class AgentChannel:
    """Frames to and from one sandbox's agent; exec() runs one command over it."""

    def __init__(self, sandbox_id: str, to_agent: int, from_agent: int) -> None:
        self.sandbox_id = sandbox_id
        self._w = to_agent
        self._r = from_agent
        os.set_blocking(self._w, False)
        os.set_blocking(self._r, False)
        self._out = bytearray()         # frames not yet taken by the pipe
        self._buf = bytearray()
        self._execs: dict[int, _Exec] = {}
        self._next = 0
        self._calls: dict[int, asyncio.Future] = {}    # 'H' requests awaiting their answer
        self._held: bytearray | None = None            # frames kept back while the agent is quiet
        self.ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self.closed: asyncio.Future = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().add_reader(self._r, self._on_readable)

    # ------------------------------------------------------------ transport

    def _send(self, kind: bytes, xid: int, payload: bytes = b"", *, urgent: bool = False) -> None:
        if self.closed.done():
            raise SandboxGone(f"sandbox {self.sandbox_id} is not running (its agent is gone)")
        frame = HEAD.pack(5 + len(payload), kind[0], xid) + payload
        if self._held is not None and not urgent:
            self._held += frame
            return
        self._write(frame)

    def _write(self, frame: bytes) -> None:
        if not self._out:
            try:
                frame = frame[os.write(self._w, frame):]
            except BlockingIOError:
                pass
            except (BrokenPipeError, OSError):
                self._close("its agent's stdin is gone")
                raise SandboxGone(f"sandbox {self.sandbox_id} is not running (its agent is gone)") from None
            if not frame:
                return
            asyncio.get_running_loop().add_writer(self._w, self._on_writable)
        self._out += frame

    def _on_writable(self) -> None:
        try:
            del self._out[:os.write(self._w, self._out)]
        except BlockingIOError:
            return
        except OSError:
            self._close("its agent's stdin is gone")
            return
        if not self._out:
            asyncio.get_running_loop().remove_writer(self._w)

    def _on_readable(self) -> None:
        try:
            data = os.read(self._r, 1 << 20)
        except BlockingIOError:
            return
        except OSError as exc:
            self._close(f"reading its agent failed: {exc}")
            return
        if not data:
            self._close("its agent exited")
            return
        self._buf += data
        off = 0
        while len(self._buf) - off >= 4:
            (length,) = struct.unpack_from("<I", self._buf, off)
            if len(self._buf) - off - 4 < length:
                break
            _, kind, xid = HEAD.unpack_from(self._buf, off)
            self._frame(chr(kind), xid, bytes(self._buf[off + 9:off + 4 + length]))
            off += 4 + length
        del self._buf[:off]

    def _frame(self, kind: str, xid: int, payload: bytes) -> None:
        if kind == "R":
            if not self.ready.done():
                self.ready.set_result(None)
            return
        if kind == "H":
            call = self._calls.pop(xid, None)
            if call is not None and not call.done():
                call.set_result(payload)
            return
        ex = self._execs.get(xid)
        if ex is None:
            return
        if kind == "O":
            ex.queue.put_nowait(("stdout", payload))
        elif kind == "e":
            ex.queue.put_nowait(("stderr", payload))
        elif kind in "AC":
            if ex.acks:
                ack = ex.acks.pop(0)
                if not ack.done():
                    ack.set_result(kind == "A")
        elif kind == "P" and len(payload) >= 4:   # started (before any of its output on this channel)
            ex.queue.put_nowait(("started", struct.unpack_from("<I", payload)[0]))
        elif kind == "F":
            ex.failure = payload
        elif kind == "X":
            status, cpu_us, rss_kib = struct.unpack("<iQQ", payload[:20])
            ex.running = False
            ex.queue.put_nowait(("exit", (status, cpu_us / 1e6, rss_kib * 1024)))

    def _close(self, why: str) -> None:
        """The agent is gone: every exec ends with SandboxGone."""
        if self.closed.done():
            return
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._r)
        if self._out:
            loop.remove_writer(self._w)
        self.closed.set_result(why)
        if not self.ready.done():
            self.ready.set_exception(BackendError(f"sandbox {self.sandbox_id}: {why} before it was ready"))
        for call in self._calls.values():
            if not call.done():
                call.set_exception(SandboxGone(f"sandbox {self.sandbox_id} is not running ({why})"))
        for ex in self._execs.values():
            ex.running = False
            for ack in ex.acks:
                if not ack.done():
                    ack.set_result(False)
            ex.queue.put_nowait(("gone", why))

    def close(self) -> None:
        """Close both pipes (the agent then reads EOF and exits)."""
        self._close("the sandbox is being destroyed")
        for fd in (self._w, self._r):
            try:
                os.close(fd)
            except OSError:
                pass

    async def set_hostname(self, name: str) -> None:
        """sethostname inside the sandbox (the agent keeps CAP_SYS_ADMIN for this; execs do not)."""
        await self._call(b"H", name.encode(), f"sethostname {name!r}")

    async def wake(self, name: str, timeout: float = 10.0) -> None:
        """A VM restored from a template: set its clock to the host's, reseed its RNG from the host's
        randomness, name it; the channel is ready once the agent answered."""
        now = time.clock_gettime_ns(time.CLOCK_REALTIME)
        await self._call(b"W", struct.pack("<qq", now // 10**9, now % 10**9) + os.urandom(32) + name.encode(),
                         f"waking as {name!r}", timeout)
        if not self.ready.done():
            self.ready.set_result(None)

    async def freeze_upper(self, frozen: bool, timeout: float = 60.0) -> list[str]:
        """A microVM's writable layer frozen (its writers wait; readers go on) or thawed; a freeze answers
        the paths of its opaque dirs, relative to the layer."""
        rest = await self._call(b"Z", b"\1" if frozen else b"\0", "freezing the writable layer" if frozen
                                else "thawing the writable layer", timeout)
        return [p.decode(errors="surrogateescape") for p in rest.split(b"\0")[:-1]]

    async def quiesce(self, timeout: float = 10.0) -> None:
        """Before a VM's memory is saved: from now on every frame to the agent is held back, and the agent,
        once it answered, sends nothing; so the channel's state in the VM is between frames both ways.
        release() ends it."""
        self._held = bytearray()
        try:
            await self._call(b"Q", b"", "quiescing its agent", timeout, urgent=True)
        except BaseException:
            self._unhold()
            raise

    async def release(self, detach: bool, timeout: float = 10.0) -> None:
        """The agent speaks again; the held frames follow. detach: this is a VM started from a memory
        snapshot, whose agent quiesced under another edge: its running execs are nobody's (they run on, their
        output is dropped) and this channel numbers its own execs above theirs."""
        xid, call = self._request(b"U", b"\1" if detach else b"\0", urgent=True)
        self._unhold()
        rest = await self._answer(xid, call, "waking its agent", timeout)
        if detach and len(rest) >= 4:
            self._next = max(self._next, struct.unpack_from("<I", rest)[0])

    def _unhold(self) -> None:
        held, self._held = self._held, None
        if held and not self.closed.done():
            self._write(bytes(held))

    async def _call(self, kind: bytes, payload: bytes, what: str, timeout: float = 10.0, *,
                    urgent: bool = False) -> bytes:
        """One request the agent answers with an errno and maybe more ('H' frames): what follows the errno."""
        xid, call = self._request(kind, payload, urgent=urgent)
        return await self._answer(xid, call, what, timeout)

    def _request(self, kind: bytes, payload: bytes, *, urgent: bool = False) -> tuple[int, asyncio.Future]:
        self._next += 1
        xid = self._next
        call = self._calls[xid] = asyncio.get_running_loop().create_future()
        self._send(kind, xid, payload, urgent=urgent)
        return xid, call

    async def _answer(self, xid: int, call: asyncio.Future, what: str, timeout: float) -> bytes:
        done, _ = await asyncio.wait({call, self.closed}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if call not in done:
            self._calls.pop(xid, None)
            raise BackendError(f"{what} in sandbox {self.sandbox_id}: "
                               f"{'its agent is gone' if self.closed.done() else f'no answer within {timeout:.0f}s'}")
        (errno,) = struct.unpack_from("<I", call.result())
        if errno:
            raise BackendError(f"{what} in sandbox {self.sandbox_id}: {os.strerror(errno)}")
        return call.result()[4:]

    # ------------------------------------------------------------ exec

    async def exec(self, argv: list[str], env: dict[str, str], cwd: str, stdin: bytes | None,
                   timeout: float, sink: OutputSink, control: ExecControl | None,
                   frozen_for=lambda: 0.0, user=None, pty: tuple[int, int] | None = None) -> ExecResult:
        """Run argv in the sandbox (as user, a users.ExecUser; None: its root; on a terminal of pty's (rows,
        cols), resized through control); stream output to sink; kill its tree on timeout."""
        self._next += 1
        xid = self._next
        ex = self._execs[xid] = _Exec()
        started = time.monotonic()
        who = [user.spec()] if user is not None else []
        size = [f"{pty[0]} {pty[1]}"] if pty is not None else []
        words = [cwd, *who, *size, *argv, *(f"{k}={v}" for k, v in env.items())]
        if any("\0" in w for w in words):
            raise BackendError("NUL byte in argv, env or cwd")
        flags = (WITH_USER if who else 0) | (WITH_TTY if size else 0) | \
            (WITH_END if control is not None and control.end_on_exit else 0)
        payload = struct.pack("<II", len(argv) | flags, len(env)) + b"".join(w.encode() + b"\0" for w in words)
        try:
            self._send(b"E", xid, payload)
            if control is not None:
                control.on_signal(lambda sig: self._signal(xid, sig))
                if pty is not None:
                    control.on_resize(lambda rows, cols: self._send(b"Y", xid, struct.pack("<HH", rows, cols)))
            feeder = asyncio.ensure_future(self._feed(xid, ex, stdin or b"", control))
            drain = asyncio.ensure_future(self._drain(xid, ex, sink, control))
            timed_out = False
            try:
                try:
                    await execio.wait_unfrozen(drain, timeout, frozen_for)
                except asyncio.TimeoutError:
                    timed_out = True
                    self._send(b"K", xid)
                    try:
                        await asyncio.wait_for(asyncio.shield(drain), KILL_GRACE)
                    except asyncio.TimeoutError:
                        raise BackendError("command killed but its output pipes stayed open") from None
                status, cpu, peak = drain.result()
            except BaseException:
                if ex.running and not self.closed.done():
                    self._send(b"K", xid)
                raise
            finally:
                drain.cancel()
                feeder.cancel()
                await asyncio.gather(drain, feeder, return_exceptions=True)
        finally:
            self._execs.pop(xid, None)
            if control is not None:
                control.close()
        result = ExecResult(exit_code=execio.exit_code(status), duration=time.monotonic() - started,
                            cpu_time=cpu, peak_memory=peak, timed_out=timed_out)
        failure = execio.exec_failure(ex.failure, argv, cwd)
        if failure and not timed_out:
            raise CommandNotStarted(failure, ExecResult(-1, result.duration, cpu, peak))
        return result

    async def _drain(self, xid: int, ex: _Exec, sink: OutputSink,
                     control: ExecControl | None) -> tuple[int, float, int]:
        """Hand output to the sink in order, granting credit back (and the pid to control when it started);
        the exit status once it comes."""
        owed = 0
        while True:
            kind, data = await ex.queue.get()
            if kind == "exit":
                return data
            if kind == "started":
                if control is not None:
                    await control.started(data)
                continue
            if kind == "gone":
                raise SandboxGone(f"sandbox {self.sandbox_id} is not running ({data})")
            await sink(kind, data)
            owed += len(data)
            if owed >= GRANT_EVERY and ex.running:
                self._send(b"G", xid, struct.pack("<I", owed))
                owed = 0

    async def _write_stdin(self, xid: int, ex: _Exec, data: bytes) -> bool:
        """One stdin frame per 64 KiB, each acknowledged before the next (empty data: close stdin)."""
        for off in range(0, max(len(data), 1), STDIN_CHUNK):
            if not ex.running:
                return False
            ack = asyncio.get_running_loop().create_future()
            ex.acks.append(ack)
            self._send(b"I", xid, data[off:off + STDIN_CHUNK])
            if not await ack:
                return False
        return True

    async def _feed(self, xid: int, ex: _Exec, first: bytes, control: ExecControl | None) -> None:
        ok = not first or await self._write_stdin(xid, ex, first)
        if control is not None and control.live_stdin:
            while True:
                data, done = await control.next_input()
                if data is None:
                    done.set_result(ok and await self._write_stdin(xid, ex, b""))
                    return
                if data:   # (an empty frame would close its stdin)
                    ok = ok and await self._write_stdin(xid, ex, data)
                done.set_result(ok)
        elif ok:
            await self._write_stdin(xid, ex, b"")

    async def _signal(self, xid: int, sig: int) -> bool:
        ex = self._execs.get(xid)
        if ex is None or not ex.running or self.closed.done():
            return False
        self._send(b"K" if sig == signal.SIGKILL else b"S", xid, struct.pack("<I", sig))
        return True
