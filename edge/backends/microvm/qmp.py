"""A QEMU Machine Protocol client over one connected socket (the VM's `-chardev socket,fd=N` monitor):
JSON lines, one command answered at a time, asynchronous events skipped."""
from __future__ import annotations

import asyncio
import json
import socket


class QmpError(Exception):
    """QEMU refused a command, or its monitor is gone."""


class Qmp:
    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._lock = asyncio.Lock()
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._streams is None:
            reader, writer = await asyncio.open_connection(sock=self._sock)
            self._streams = (reader, writer)
            await self._answer(reader)      # the greeting
            writer.write(b'{"execute": "qmp_capabilities"}\n')
            await self._answer(reader)
        return self._streams

    @staticmethod
    async def _answer(reader: asyncio.StreamReader) -> dict:
        while True:
            line = await reader.readline()
            if not line:
                raise QmpError("QEMU's monitor closed")
            msg = json.loads(line)
            if "event" in msg:
                continue
            if "error" in msg:
                raise QmpError(f"{msg['error'].get('class')}: {msg['error'].get('desc')}")
            return msg

    async def execute(self, command: str, timeout: float = 10.0, *, fd: int | None = None, **arguments) -> object:
        """Run one command (with fd passed beside it, as `getfd` wants); its `return` value."""
        async with self._lock:
            async def run() -> object:
                reader, writer = await self._open()
                line = json.dumps({"execute": command, **({"arguments": arguments} if arguments else {})}).encode()
                if fd is None:
                    writer.write(line + b"\n")
                else:       # SCM_RIGHTS beside the line: nothing else is queued (one command at a time)
                    await writer.drain()
                    socket.send_fds(self._sock, [line + b"\n"], [fd])
                return (await self._answer(reader)).get("return")
            try:
                return await asyncio.wait_for(run(), timeout)
            except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.TimeoutError) as exc:
                raise QmpError(f"QEMU's monitor: {exc}") from exc

    def close(self) -> None:
        if self._streams is not None:
            self._streams[1].close()
        else:
            self._sock.close()
