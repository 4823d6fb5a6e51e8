"""AsyncSandbox: exec, stream, files and destroy for one sandbox, by id and node."""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, Any, AsyncIterable, AsyncIterator, Sequence

from bus import kinds, subjects, validate
from bus.errors import AuthenticationFailed, BusError, DsecError, InvalidRequest, PermissionDenied, SandboxNotFound
from bus.network import Network as WireNetwork
from bus.execwire import ProcessEntry, process_list_decoder
from bus.messages import (
    DestroyRequest, ExecRequest, ListProcesses, ReadFile, ResumeRequest, RollbackRequest, SetNetworkRequest,
    SetTimeoutRequest, SnapshotRequest, SuspendRequest, WriteFile, encode)
from bus.records import SnapshotRecord, snapshot_decoder
from libdsec.exechandle import ExecHandle
from libdsec.execcontrol import ExecControls
from libdsec.files import AsyncFiles, check_mode
from libdsec.execstream import EXIT_GRACE, ExecStream
from libdsec.ids import new_id
from libdsec.network import to_wire as network_policy
from libdsec.results import Exit, Output

if TYPE_CHECKING:
    from libdsec.client import AsyncClient

Command = str | Sequence[str]
Stdin = bytes | str | AsyncIterable[bytes | str] | bool | None
DEFAULT_EXEC_TIMEOUT = 30.0
DEFAULT_BACKGROUND_TIMEOUT = 24 * 3600.0
DEFAULT_OP_TIMEOUT = 30.0
DEFAULT_MAX_OUTPUT = 16 << 20
PUBLISH_RETRIES = 3     # transport retries of an idempotent publish (the exec id dedupes them)...
PUBLISH_RETRY_FOR = 10.0   # ...kept up this long: a stream leader moving to another server takes seconds
PUBLISH_TRY = 1.0       # seconds one try waits for its ack (a stream without a leader answers nothing)
MAX_FILE_OP = 700_000   # one message (1 MiB max payload, base64 in JSON) per file op
LEFT_KILL = 5.0         # seconds a call left before its command's end waits for it to be killed
START_BY = 30.0         # seconds within which a node must start an exec (or never: its request's deadline)
LOGIN_SHELL = "if [ -x /bin/bash ]; then exec /bin/bash -i -l; fi; exec /.dsec/sh -i"   # sb.terminal()'s default


def argv_of(cmd: Command) -> list[str]:
    """A list command is its argv, run as is inside the sandbox."""
    try:
        argv = list(cmd)
    except TypeError:   # None, a number: not a command
        argv = []
    if not argv or not all(isinstance(a, str) for a in argv) or not argv[0]:
        raise InvalidRequest("command must be a string or a non-empty list of strings, the first not empty "
                             "(an empty argument after it is passed as one)")
    return argv


def command_fields(cmd: Command) -> dict:
    """ExecRequest fields for a command: a str runs under the edge's trusted shell (/.dsec/sh, a static bash
    the sandbox cannot replace, never the image's /bin/sh); a list is the argv itself."""
    if isinstance(cmd, str):
        if not cmd or "\0" in cmd:
            raise InvalidRequest("command must be a non-empty string without NUL bytes")
        return {"shell": cmd}
    return {"argv": argv_of(cmd)}


def _left(entry: ProcessEntry) -> float:
    """Seconds a running exec has left before its timeout (at least 1)."""
    return max(1.0, entry.started_at + entry.timeout - time.time())


async def send_request(bus, subject: str, data: bytes, msg_id: str, until: float) -> BusError | None:
    """Publish a request once, with transport retries until `until` at most (its msg id stores it once): None
    when the bus acked it, else the BusError. One not acked may still be taken (it waits in our connection's
    buffer, or in a stopped server's socket): the caller sends it again or asks whether it was. A refusal
    (credential, permission) and a connection closed for good (nothing will take it later) raise."""
    try:
        await bus.publish(subject, data, msg_id=msg_id, timeout=PUBLISH_TRY, retries=PUBLISH_RETRIES,
                          retry_for=max(0.0, min(PUBLISH_RETRY_FOR, until - time.time())))
        return None
    except (PermissionDenied, AuthenticationFailed):
        raise
    except BusError as exc:
        if bus.nc.is_closed:
            raise
        return exc


async def _send_until_taken(bus, subject: str, data: bytes, msg_id: str, give_up: float) -> None:
    """Publish an exec request until the bus acks it, again and again (send_request) until `give_up`, which
    is near its start deadline (past that no node starts it), then BusError: it will not run."""
    while True:
        try:
            if (unsent := await send_request(bus, subject, data, msg_id, give_up)) is None:
                return
        except (PermissionDenied, AuthenticationFailed):
            raise
        except BusError as exc:   # the connection closed for good
            unsent = exc
        if bus.nc.is_closed or time.time() >= give_up:
            raise BusError(f"{unsent}; the exec was not taken before its start deadline: it will not run",
                           exec_id=msg_id) from unsent


async def _abandon(handle: ExecHandle, why: BaseException | None) -> None:
    """A command its call (exec, stream) started, left before its exit was read (a cancel, a break, an error
    reading it): killed, then no longer listened to. Not when its sandbox is gone (nothing to kill: no wait
    for a node that may not answer)."""
    try:
        if not handle.done and not isinstance(why, SandboxNotFound):
            with contextlib.suppress(DsecError, asyncio.TimeoutError):
                await asyncio.wait_for(handle.kill(), LEFT_KILL)
    finally:
        await handle.close()


_LEFT: set[asyncio.Task] = set()   # kills of commands left as they were sent, running on


def _abandon_later(handle: ExecHandle, why: BaseException) -> None:
    task = asyncio.ensure_future(_abandon(handle, why))
    _LEFT.add(task)
    task.add_done_callback(_LEFT.discard)


class AsyncSandbox:
    """A handle on one running sandbox; any client may hold one for the same id."""

    def __init__(self, client: "AsyncClient", sandbox_id: str, node: str, backend: str = "container",
                 network: WireNetwork | None = None) -> None:
        self.client = client
        self.id = sandbox_id
        self.node = node
        self.backend = backend   # its kind: operations the kind lacks are refused here (Unsupported)
        self.network = network or WireNetwork()   # its network policy (mode, allow, bandwidth, max_connections)
        self.files = AsyncFiles(self)             # its file tree, files of any size (libdsec/files.py)

    def __repr__(self) -> str:
        return f"AsyncSandbox(id={self.id!r}, node={self.node!r}, backend={self.backend!r})"

    def _needs(self, capability: str, operation: str) -> None:
        kinds.require(self.backend, capability, operation)

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        from bus.errors import SandboxNotFound
        try:
            await self.destroy()
        except SandboxNotFound:
            pass

    async def _start(self, cmd: Command, timeout: float, cwd: str | None, env: dict[str, str] | None,
                     stdin: Stdin, max_output: int, background: bool = False,
                     keep_output: bool = True, user: str | None = None, what: dict | None = None,
                     pty: tuple[int, int] | None = None, end_on_exit: bool = False) -> ExecHandle:
        """Send an exec (what: its fields instead of cmd's, e.g. a watch) and a handle on it."""
        validate.seconds(timeout, "timeout")
        if not isinstance(max_output, int) or isinstance(max_output, bool) or max_output <= 0:
            raise InvalidRequest(f"max_output must be a positive number of bytes, got {max_output!r}")
        if stdin is True and not background:   # (nothing could write it: the command sat out its timeout)
            raise InvalidRequest("stdin=True (a live stdin written later) needs exec(background=True); a foreground "
                                 "exec or stream takes stdin as bytes, str or an async iterable")
        live = stdin is not None and not isinstance(stdin, (bytes, bytearray, str))
        self._needs("exec", "exec")
        kinds.require_user(self.backend, user, "exec")
        if live:
            self._needs("live_stdin", "live stdin")
        if live and stdin is not True and not hasattr(stdin, "__aiter__"):
            raise InvalidRequest("stdin must be bytes, str or an async iterable of bytes/str")
        first = b"" if live or stdin is None else (stdin.encode() if isinstance(stdin, str) else bytes(stdin))
        if len(first) > MAX_FILE_OP:
            raise InvalidRequest(f"stdin: at most {MAX_FILE_OP} bytes in one exec request, got {len(first)} "
                                 "(an async iterable streams any amount)")
        bus = self.client._need_bus()
        req = ExecRequest(exec_id=new_id("x"), sandbox_id=self.id, **(what or command_fields(cmd)), env=dict(env or {}),
                          cwd=cwd or "", user=user or "", stdin=first, timeout=float(timeout),
                          deadline=time.time() + min(timeout, START_BY) + EXIT_GRACE,   # no node starts it later
                          max_output=max_output, live_stdin=live, background=background,
                          pty_rows=pty[0] if pty else 0, pty_cols=pty[1] if pty else 0, end_on_exit=end_on_exit)
        validate.check_exec_words(req.argv, req.env, req.cwd, req.shell, req.user)
        stream = ExecStream(bus, self.node, self.id, req.exec_id, self.client.tenant,
                            record=lambda: self.client._record_quiet(self.id))
        await stream.open()
        handle = ExecHandle(bus, subjects.exec_input(self.node, self.client.tenant, self.id, req.exec_id), self.id,
                            req.exec_id, stream, timeout, keep_output)
        try:
            await _send_until_taken(bus, subjects.node_ops(self.node, self.client.tenant, self.id), encode(req),
                                    req.exec_id, req.deadline - EXIT_GRACE)
        except asyncio.CancelledError as exc:   # left while it was being sent: the bus may have it all the same,
            _abandon_later(handle, exc)          # and its node would run it (13 of 40 quick cancels did): killed,
            raise                                # in the background (the cancel is not held up by it)
        except BaseException:
            await handle.close()
            raise
        if live and stdin is not True:
            handle.feed(stdin)  # type: ignore[arg-type]
        return handle

    async def terminal(self, cmd: Command | None = None, *, rows: int = 24, cols: int = 80, cwd: str | None = None,
                       env: dict[str, str] | None = None, user: str | None = None,
                       timeout: float = DEFAULT_BACKGROUND_TIMEOUT) -> ExecHandle:
        """A command on a terminal of the sandbox's own (default: an interactive login bash where the image has
        one, else the trusted sh): its output one byte stream (stream(lines=False): Output("stdout", bytes)),
        its input handle.send_stdin(bytes) as typed, handle.resize(rows, cols); TERM=xterm-256color unless env
        sets it. Like any background exec it has a pid, is listed, attached to and killed by pid."""
        self._needs("pty", "terminal")
        if not all(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 4096 for v in (rows, cols)):
            raise InvalidRequest(f"rows and cols must be 1..4096, got {rows!r}x{cols!r}")
        return await self._start(cmd or LOGIN_SHELL, timeout, cwd, env, True, DEFAULT_MAX_OUTPUT, background=True,
                                 user=user, pty=(rows, cols))

    async def resize_terminal(self, pid: int, rows: int, cols: int) -> bool:
        """Resize the terminal of the running exec with that pid; False when it ended meanwhile."""
        entry = await self._running(pid=pid)
        assert entry is not None
        return await self._controls(entry).resize(rows, cols)

    async def processes(self, *, timeout: float = DEFAULT_OP_TIMEOUT) -> list[ProcessEntry]:
        """Its execs still running, oldest first: exec_id, pid (in the sandbox), argv or shell, env, cwd,
        user, started_at, timeout."""
        self._needs("exec", "processes")
        data = await self.client._op(self.node, self.id, lambda rid, to, dl: ListProcesses(
            request_id=rid, sandbox_id=self.id, reply_to=to, deadline=dl), timeout)
        return process_list_decoder.decode(data).processes

    async def _running(self, exec_id: str | None = None, pid: int | None = None) -> ProcessEntry | None:
        """The running exec of that id (or pid); InvalidRequest for a pid that none has."""
        if exec_id is None and (isinstance(pid, bool) or not isinstance(pid, int)):
            raise InvalidRequest(f"pid must be an int, got {pid!r}")
        entry = next((p for p in await self.processes() if (p.exec_id == exec_id if exec_id else p.pid == pid)), None)
        if entry is None and not exec_id:
            raise InvalidRequest(f"no running command of sandbox {self.id} has pid {pid}")
        return entry

    def _stream(self, exec_id: str) -> ExecStream:
        return ExecStream(self.client._need_bus(), self.node, self.id, exec_id, self.client.tenant,
                          record=lambda: self.client._record_quiet(self.id))

    async def attach(self, exec_id: str | None = None, *, pid: int | None = None,
                     keep_output: bool = True) -> ExecHandle:
        """A handle on an exec started before (by any client, a crashed one too), by its exec id or its pid
        while it runs: its output from the first byte on (what DSEC_OUT holds), its end, kill() and, for an
        exec started with stdin=True, send_stdin(). InvalidRequest when no running exec has that pid, or none
        has that exec id and DSEC_OUT holds none of its output (a wrong id, or its output aged out)."""
        entry = await self._running(exec_id, pid)
        exec_id = entry.exec_id if entry is not None else exec_id
        try:
            subjects.token(exec_id, "exec_id")
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        left = _left(entry) if entry is not None else 1.0
        stream = self._stream(exec_id)
        if entry is None and not await stream.holds_any():   # (it waited 16 s, then blamed the node)
            raise InvalidRequest(f"sandbox {self.id} has no exec {exec_id}: none by that id is running, and DSEC_OUT "
                                 "holds no output of it (a wrong id, or its output aged out or was purged)")
        await stream.open(replay=True)
        return ExecHandle(self.client._need_bus(), subjects.exec_input(self.node, self.client.tenant, self.id, exec_id),
                          self.id, exec_id, stream, left, keep_output)

    def _controls(self, entry: ProcessEntry) -> ExecControls:
        left = _left(entry) + EXIT_GRACE
        return ExecControls(self.client._need_bus(), subjects.exec_input(self.node, self.client.tenant, self.id,
                                                                          entry.exec_id),
                            entry.exec_id, time.monotonic() + left, ended=self._stream(entry.exec_id).ended)

    async def kill_process(self, pid: int, signal: int = 9) -> bool:
        """Send signal to the running exec whose pid is `pid` (SIGKILL, the default: its whole process tree);
        False when no running exec has that pid (it ended), or it ended meanwhile."""
        try:
            entry = await self._running(pid=pid)
        except InvalidRequest:
            if isinstance(pid, int) and not isinstance(pid, bool):
                return False
            raise
        assert entry is not None
        return await self._controls(entry).signal(signal)

    async def send_stdin(self, pid: int, data: bytes | str, *, eof: bool = False) -> bool:
        """Write data to the live stdin of the running exec whose pid is `pid` (started with stdin=True), after
        whatever any client sent before; eof=True closes it after. False when it ended or closed its stdin;
        InvalidRequest when no running exec has that pid, or it has no live stdin."""
        entry = await self._running(pid=pid)
        assert entry is not None
        return await self._controls(entry).send(data, eof)

    async def stream(self, cmd: Command, *, timeout: float = DEFAULT_EXEC_TIMEOUT, cwd: str | None = None,
                     env: dict[str, str] | None = None, stdin: Stdin = None,
                     max_output: int = DEFAULT_MAX_OUTPUT, user: str | None = None,
                     lines: bool = True) -> AsyncIterator[Output | Exit]:
        """Yield Output per line as it is produced, then one Exit (timed_out set if the timeout fired).
        lines=False: per chunk as it arrives, a line not finished yet too.
        stdin: bytes/str given at once, or an async iterable whose pieces reach the command as it yields
        them (interactive; its end closes the command's stdin). The command is this loop's: left before
        the Exit (a break, an exception, a cancel) it is killed (exec(background=True) leaves one running)."""
        handle = await self._start(cmd, timeout, cwd, env, stdin, max_output, keep_output=False, user=user)
        try:
            async for ev in handle.stream(lines):
                yield ev
        except BaseException as exc:
            await _abandon(handle, exc)
            raise
        await _abandon(handle, None)

    async def exec(self, cmd: Command, *, timeout: float | None = None, cwd: str | None = None,
                   env: dict[str, str] | None = None, stdin: Stdin = None,
                   max_output: int = DEFAULT_MAX_OUTPUT, background: bool = False, user: str | None = None,
                   end_on_exit: bool = False) -> Any:
        """Run a command to the end and return its ExecResult; ExecTimeout (with the partial output) if it
        outlived `timeout` (default 30 s). background=True returns an ExecHandle once it started instead
        (.pid: its pid; default timeout 24 h): stream its output, wait() for it or kill() it later. cwd defaults to the image's
        WorkingDir (else /); user to the image's User (else root): a name of the image's /etc/passwd or
        uid[:gid] (kinds with the "users" capability), run with its groups and HOME. stdin as stream()'s, or
        True with background=True: a live stdin written later, by this or any client, with
        handle.send_stdin() / close_stdin() (sb.attach(pid=...) finds it again). A foreground exec is this call's:
        cancelled (or failing to read its end) it is killed. It ends once its command exited and every process
        holding its stdout or stderr closed them (`server &` keeps it running, as subprocess and docker exec
        do); end_on_exit=True: once its command exited, with what its output held then, and a process it left
        running keeps on, its later output not read (E2B's commands.run)."""
        if timeout is None:
            timeout = DEFAULT_BACKGROUND_TIMEOUT if background else DEFAULT_EXEC_TIMEOUT
        handle = await self._start(cmd, timeout, cwd, env, stdin, max_output, background, user=user,
                                   end_on_exit=end_on_exit)
        if background:    # once it started: h.pid is its pid (it was 0, and send_stdin(h.pid) found no command)
            try:
                await handle.started()
            except BaseException:
                await handle.close()
                raise
            return handle
        try:
            result = await handle.wait()
        except BaseException as exc:
            await _abandon(handle, exc)
            raise
        await handle.close()
        return result

    async def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644,
                         timeout: float = DEFAULT_OP_TIMEOUT) -> None:
        """Write a file inside the sandbox (paths resolve inside its root)."""
        self._needs("files", "write_file")
        validate.file_path(path)
        check_mode(mode)
        if isinstance(data, str):
            data = data.encode()
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidRequest(f"data must be bytes or str, got {type(data).__name__}")
        if len(data) > MAX_FILE_OP:
            raise InvalidRequest(f"data: write_file takes at most {MAX_FILE_OP} bytes per call, got {len(data)} "
                                 "(sb.files.write writes any size, a piece per request)")
        await self.client._op(self.node, self.id, lambda rid, to, dl: WriteFile(
            request_id=rid, sandbox_id=self.id, path=path, data=data, mode=mode, reply_to=to, deadline=dl), timeout)

    async def read_file(self, path: str, *, limit: int = MAX_FILE_OP, timeout: float = DEFAULT_OP_TIMEOUT) -> bytes:
        """Read a file inside the sandbox (at most `limit` bytes: 1..700,000; sb.files.read reads any size)."""
        self._needs("files", "read_file")
        validate.file_path(path)
        if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_FILE_OP:
            raise InvalidRequest(f"limit must be 1..{MAX_FILE_OP} bytes, got {limit!r}")
        return await self.client._op(self.node, self.id, lambda rid, to, dl: ReadFile(
            request_id=rid, sandbox_id=self.id, path=path, limit=limit, reply_to=to, deadline=dl), timeout)

    async def snapshot(self, *, tag: str = "", memory: bool = False, timeout: float = 120.0) -> SnapshotRecord:
        """Freeze it briefly, pack its writable layer as a new layer over its own and store it; returns the
        snapshot (`.id`, `.tag`, `.layers`, `.size`...) to create, fork or roll back from.

        memory=True (VM kinds: capability memory_snapshot): its memory and device state too, so forks go on
        from this instant with every process where it was (`.memory_node` holds it; forks with memory run
        there, and die with that node's edge; its files fork anywhere). The VM stops for about a second."""
        self._needs("snapshot", "snapshot")
        if memory:
            self._needs("memory_snapshot", "snapshot(memory=True)")
        validate.check_tag(tag)
        if not isinstance(memory, bool):
            raise InvalidRequest(f"memory must be True or False, got {memory!r}")
        data = await self.client._op(self.node, self.id, lambda rid, to, dl: SnapshotRequest(
            request_id=rid, sandbox_id=self.id, tag=tag, reply_to=to, deadline=dl, memory=memory), timeout)
        return snapshot_decoder.decode(data)

    async def rollback(self, snapshot: SnapshotRecord | str, *, timeout: float = 120.0) -> None:
        """Return its filesystem to a snapshot: it restarts on the snapshot's layers with a fresh writable
        layer (same id and node; every process, background execs included, starts afresh), and its execs'
        default cwd and user become the snapshot's and its env the snapshot's under its own, as a fork of it
        given that env gets them (a snapshot of another sandbox too: a fork going back to where it came from
        keeps what it was forked with). snapshot: a record, an id or a tag (its newest, as fork takes it);
        ImageNotFound when there is none."""
        self._needs("snapshot", "rollback")
        snap_id = (await self.client.snapshot(snapshot)).id
        await self.client._op(self.node, self.id, lambda rid, to, dl: RollbackRequest(
            request_id=rid, sandbox_id=self.id, snapshot_id=snap_id, reply_to=to, deadline=dl), timeout)

    async def set_network(self, network: Any, *, timeout: float = DEFAULT_OP_TIMEOUT) -> None:
        """Change its network policy ("mirror-only" or libdsec.Network(allow=[...])): in force for every
        connection it opens once this returns (connections open now go on). A bad policy raises
        InvalidRequest and leaves the old one in force; a sandbox created with network "none" keeps it
        (Unsupported)."""
        self._needs("network", "set_network")
        policy = network_policy(network)
        await self.client._op(self.node, self.id, lambda rid, to, dl: SetNetworkRequest(
            request_id=rid, sandbox_id=self.id, network=policy, reply_to=to, deadline=dl), timeout)
        self.network = policy

    async def suspend(self, *, timeout: float = DEFAULT_OP_TIMEOUT) -> None:
        """Freeze this sandbox (see AsyncClient.suspend; a suspended one stays so); SandboxNotFound if it
        does not run."""
        self._needs("suspend", "suspend")
        await self.client._op(self.node, self.id, lambda rid, to, dl: SuspendRequest(
            request_id=rid, sandbox_id=self.id, reply_to=to, deadline=dl), timeout)

    async def resume(self, *, timeout: float = DEFAULT_OP_TIMEOUT) -> None:
        """Thaw it (see AsyncClient.resume); SandboxNotFound if it does not run."""
        self._needs("suspend", "resume")
        await self.client._op(self.node, self.id, lambda rid, to, dl: ResumeRequest(
            request_id=rid, sandbox_id=self.id, reply_to=to, deadline=dl), timeout)

    async def set_timeout(self, seconds: float, *, timeout: float = DEFAULT_OP_TIMEOUT) -> None:
        """It now expires `seconds` from now, shorter or longer than before (0: at once; at most a create's
        longest ttl, 7 days); a suspended one's count starts when it is resumed."""
        validate.seconds(seconds, "seconds", zero=True)
        if seconds > validate.MAX_TTL:   # (a month was taken here: more than any create may ask)
            raise InvalidRequest(f"seconds must be at most {validate.MAX_TTL:.0f} (7 days, a create's longest ttl), "
                                 f"got {seconds!r}")
        await self.client._op(self.node, self.id, lambda rid, to, dl: SetTimeoutRequest(
            request_id=rid, sandbox_id=self.id, timeout=float(seconds), reply_to=to, deadline=dl), timeout)

    async def destroy(self, *, timeout: float = DEFAULT_OP_TIMEOUT) -> None:
        """Destroy it; SandboxNotFound if it is already gone."""
        def recheck(rec) -> bytes | None:   # destroyed meanwhile (a lost reply): done
            return b"" if rec.state == "destroyed" else None

        await self.client._op(self.node, self.id, lambda rid, to, dl: DestroyRequest(
            request_id=rid, sandbox_id=self.id, reply_to=to, deadline=dl), timeout, recheck)
