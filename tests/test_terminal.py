"""sb.terminal (issue 18, E2B's pty): a command on a terminal of the sandbox's own devpts; input as typed,
output one byte stream, resize, Ctrl-C through the terminal, and the terminal's owner."""
from __future__ import annotations

import asyncio

import pytest

import libdsec

pytestmark = pytest.mark.timeout(120)


class Screen:
    """What a terminal printed so far, read as it comes."""

    def __init__(self, handle) -> None:
        self.handle = handle
        self.data = bytearray()
        self._events = handle.stream(lines=False)

    async def until(self, text: bytes, within: float = 10.0) -> bytes:
        """Read until text shows (after what was read before); what came up to it."""
        start = len(self.data)

        async def read() -> None:
            while text not in self.data[start:]:
                ev = await self._events.__anext__()
                assert isinstance(ev, libdsec.Output), ev
                assert ev.stream == "stdout"      # one stream: a terminal has no separate stderr
                self.data += ev.data
        try:
            await asyncio.wait_for(read(), within)
        except asyncio.TimeoutError:
            raise AssertionError(f"{text!r} not shown within {within}s; the screen: {bytes(self.data)!r}") from None
        return bytes(self.data[start:])


async def resize_interrupt_and_exit(h, screen: Screen, interrupt: bool = True) -> None:
    """A running shell's terminal resized (stty sees it); with interrupt, a ^C typed stops its foreground job
    (SIGINT by the terminal) and the shell goes on; `exit 3` ends it with 3."""
    assert await h.resize(50, 132)
    await h.send_stdin(b"stty size\n")
    await screen.until(b"50 132\r\n")
    if interrupt:
        await h.send_stdin(b"sleep 100; echo not-$((1+1))\n")
        await asyncio.sleep(0.5)
        await h.send_stdin(b"\x03")
        await h.send_stdin(b"echo alive-$((2+2))\n")
        shown = await screen.until(b"alive-4\r\n")
        assert b"not-2" not in shown
    await h.send_stdin(b"exit 3\n")
    assert (await h.wait()).exit_code == 3


async def test_a_terminal_takes_input_resizes_and_interrupts(client):
    async with await client.create() as sb:
        h = await sb.terminal(rows=30, cols=100)
        try:
            assert await h.started() > 1
            screen = Screen(h)
            await h.send_stdin(b"stty size; tty; echo term=$TERM; [ -c $(tty) ] && echo own-$((40+2))\n")   # (the echo of
            shown = await screen.until(b"own-42\r\n")                                    # what is typed differs)
            assert b"30 100\r\n" in shown and b"/dev/pts/0\r\n" in shown and b"term=xterm-256color\r\n" in shown
            await resize_interrupt_and_exit(h, screen)
        finally:
            await h.close()


async def test_a_terminal_of_another_user_and_by_pid(client, stack):
    async with await client.create() as sb:
        h = await sb.terminal(["/bin/sh", "-i"], user="65534:65534", rows=10, cols=40)
        pid = await h.started()
        screen = Screen(h)
        await sb.send_stdin(pid, b"echo uid=$(id -u); stat -c owner=%u $(tty)\n")    # by pid, as any client would
        shown = await screen.until(b"owner=65534\r\n")
        assert b"uid=65534\r\n" in shown
        assert await sb.resize_terminal(pid, 20, 60)
        await sb.send_stdin(pid, b"stty size\n")
        await screen.until(b"20 60\r\n")
        assert await sb.kill_process(pid)
        assert (await h.wait()).exit_code == 128 + 9
        await h.close()
        plain = await sb.exec("sleep 30", background=True)
        with pytest.raises(libdsec.InvalidRequest, match="no terminal"):
            await plain.resize(10, 10)
        with pytest.raises(libdsec.InvalidRequest, match="rows and cols"):
            await sb.terminal(rows=0)
        assert await plain.kill()
        await plain.close()
