"""AsyncSandbox: exec, stream, files and destroy for one sandbox, by id and node."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Sequence

from bus import subjects
from bus.errors import ExecTimeout, InvalidRequest
from bus.messages import DestroyRequest, ExecRequest, ExitRecord, ReadFile, WriteFile, encode
from libdsec.ids import new_id
from libdsec.execstream import EXIT_GRACE, ExecStream, LineSplitter, exit_of
from libdsec.results import ExecResult, Exit, Output

if TYPE_CHECKING:
    from libdsec.client import AsyncClient

Command = str | Sequence[str]
DEFAULT_EXEC_TIMEOUT = 30.0
DEFAULT_OP_TIMEOUT = 30.0
DEFAULT_MAX_OUTPUT = 16 << 20
PUBLISH_RETRIES = 3     # transport retries of an idempotent publish (the exec id dedupes them)...
PUBLISH_RETRY_FOR = 10.0   # ...kept up this long: a stream leader moving to another server takes seconds
MAX_FILE_OP = 700_000   # one message (1 MiB max payload, base64 in JSON) per file op


def argv_of(cmd: Command) -> list[str]:
    """A list command is its argv, run as is inside the sandbox."""
    argv = list(cmd)
    if not argv or not all(isinstance(a, str) and a for a in argv):
        raise InvalidRequest("command must be a string or a non-empty list of non-empty strings")
    return argv


def command_fields(cmd: Command) -> dict:
    """ExecRequest fields for a command: a str runs under the edge's trusted shell (a static busybox sh
    the sandbox cannot replace, never the image's /bin/sh); a list is the argv itself."""
    if isinstance(cmd, str):
        if not cmd or "\0" in cmd:
            raise InvalidRequest("command must be a non-empty string without NUL bytes")
        return {"shell": cmd}
    return {"argv": argv_of(cmd)}


class AsyncSandbox:
    """A handle on one running sandbox; any client may hold one for the same id."""

    def __init__(self, client: "AsyncClient", sandbox_id: str, node: str) -> None:
        self.client = client
        self.id = sandbox_id
        self.node = node

    def __repr__(self) -> str:
        return f"AsyncSandbox(id={self.id!r}, node={self.node!r})"

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        from bus.errors import SandboxNotFound
        try:
            await self.destroy()
        except SandboxNotFound:
            pass

    async def _start(self, cmd: Command, timeout: float, cwd: str, env: dict[str, str] | None,
                     stdin: bytes | str | None, max_output: int) -> ExecStream:
        if not isinstance(timeout, (int, float)) or not timeout > 0:
            raise InvalidRequest(f"timeout must be a positive number of seconds, got {timeout!r}")
        if isinstance(stdin, str):
            stdin = stdin.encode()
        if stdin and len(stdin) > MAX_FILE_OP:
            raise InvalidRequest(f"stdin: at most {MAX_FILE_OP} bytes per exec, got {len(stdin)}")
        bus = self.client._need_bus()
        req = ExecRequest(exec_id=new_id("x"), sandbox_id=self.id, **command_fields(cmd), env=dict(env or {}),
                          cwd=cwd, stdin=stdin or b"", timeout=float(timeout),
                          deadline=time.time() + timeout + EXIT_GRACE, max_output=max_output)
        stream = ExecStream(bus, self.id, req.exec_id, self.client.tenant)
        await stream.open()
        try:
            await bus.publish(subjects.node_ops(self.node, self.id), encode(req), msg_id=req.exec_id,
                              timeout=2.0, retries=PUBLISH_RETRIES, retry_for=PUBLISH_RETRY_FOR)
        except BaseException:
            await stream.close()
            raise
        return stream

    async def stream(self, cmd: Command, *, timeout: float = DEFAULT_EXEC_TIMEOUT, cwd: str = "/",
                     env: dict[str, str] | None = None, stdin: bytes | str | None = None,
                     max_output: int = DEFAULT_MAX_OUTPUT) -> AsyncIterator[Output | Exit]:
        """Yield Output per line as it is produced, then one Exit (timed_out set if the timeout fired)."""
        stream = await self._start(cmd, timeout, cwd, env, stdin, max_output)
        lines = LineSplitter()
        try:
            async for rec in stream.records(timeout + EXIT_GRACE):
                if isinstance(rec, ExitRecord):
                    for out in lines.flush():
                        yield out
                    yield exit_of(rec)
                    return
                for out in lines.feed(rec.stream, rec.data):
                    yield out
        finally:
            await stream.close()

    async def exec(self, cmd: Command, *, timeout: float = DEFAULT_EXEC_TIMEOUT, cwd: str = "/",
                   env: dict[str, str] | None = None, stdin: bytes | str | None = None,
                   max_output: int = DEFAULT_MAX_OUTPUT) -> ExecResult:
        """Run a command to the end; ExecTimeout (with the partial output) if it outlived `timeout`."""
        out: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        stream = await self._start(cmd, timeout, cwd, env, stdin, max_output)
        try:
            async for rec in stream.records(timeout + EXIT_GRACE):
                if isinstance(rec, ExitRecord):
                    ex = exit_of(rec)
                    break
                out[rec.stream].append(rec.data)
        finally:
            await stream.close()
        stdout, stderr = b"".join(out["stdout"]), b"".join(out["stderr"])   # one copy
        if ex.timed_out:
            raise ExecTimeout(f"command timed out after {timeout}s; its process tree was killed",
                              stdout=stdout, stderr=stderr, truncated=ex.truncated)
        return ExecResult(exit_code=ex.exit_code, stdout=stdout, stderr=stderr,
                          duration=ex.duration, cpu_time=ex.cpu_time, peak_memory=ex.peak_memory,
                          timed_out=False, truncated=ex.truncated, exec_id=ex.exec_id)

    async def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644,
                         timeout: float = DEFAULT_OP_TIMEOUT) -> None:
        """Write a file inside the sandbox (paths resolve inside its root)."""
        if isinstance(data, str):
            data = data.encode()
        if len(data) > MAX_FILE_OP:
            raise InvalidRequest(f"data: write_file takes at most {MAX_FILE_OP} bytes per call, got {len(data)}")
        await self.client._op(self.node, self.id, lambda rid, to, dl: WriteFile(
            request_id=rid, sandbox_id=self.id, path=path, data=data, mode=mode, reply_to=to, deadline=dl), timeout)

    async def read_file(self, path: str, *, limit: int = MAX_FILE_OP, timeout: float = DEFAULT_OP_TIMEOUT) -> bytes:
        """Read a file inside the sandbox."""
        return await self.client._op(self.node, self.id, lambda rid, to, dl: ReadFile(
            request_id=rid, sandbox_id=self.id, path=path, limit=limit, reply_to=to, deadline=dl), timeout)

    async def destroy(self, *, timeout: float = DEFAULT_OP_TIMEOUT) -> None:
        """Destroy it; SandboxNotFound if it is already gone."""
        async def recheck() -> bytes | None:   # destroyed meanwhile (a lost reply): done
            rec = await self.client._record_quiet(self.id)
            if rec is not None and rec.state == "destroyed":
                return b""
            return None

        await self.client._op(self.node, self.id, lambda rid, to, dl: DestroyRequest(
            request_id=rid, sandbox_id=self.id, reply_to=to, deadline=dl), timeout, recheck)
