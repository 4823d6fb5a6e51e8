"""Sandbox bytes on the operator's terminal: shown escaped, never obeyed.

What a sandbox prints is the tenant's. Raw on a terminal, it could set the clipboard (OSC 52), move
the cursor to forge or hide lines, retitle the window or switch character sets. When the stream is a
tty, every control character except newline and tab (C0, DEL, C1, also as raw 8-bit bytes), and every
byte that is not valid UTF-8, is written as a visible escape (`\\x1b`, `\\r`, `\\x9b`); text stays text.
When it is not a tty (a pipe, a file), bytes pass through exactly, so pipelines stay byte-exact.
"""
from __future__ import annotations

import codecs
import sys
from typing import BinaryIO

_NAMED = {"\r": "\\r", "\b": "\\b", "\a": "\\a", "\f": "\\f", "\v": "\\v", "\0": "\\0", "\x1b": "\\x1b"}


def _escape_char(c: str) -> str:
    o = ord(c)
    if 0xDC80 <= o <= 0xDCFF:            # a byte that was not UTF-8 (surrogateescape)
        return f"\\x{o - 0xDC00:02x}"
    if c in _NAMED:
        return _NAMED[c]
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}"


def _unsafe(c: str) -> bool:
    o = ord(c)
    return (o < 0x20 and c not in "\n\t") or 0x7F <= o <= 0x9F or 0xDC80 <= o <= 0xDCFF \
        or o in (0x2028, 0x2029, 0x202E, 0x2066, 0x2067, 0x2068, 0x2069, 0x202A, 0x202B, 0x202C, 0x202D)


def escape(text: str) -> str:
    """text with every terminal control (see the module doc) written as a visible escape."""
    return "".join(_escape_char(c) if _unsafe(c) else c for c in text)


class Terminal:
    """Writes one output stream: escaped when it is a tty, raw otherwise. A UTF-8 character split across
    two chunks is decoded whole (an incremental decoder), so only real garbage shows as `\\xNN`."""

    def __init__(self, stream: BinaryIO, tty: bool | None = None) -> None:
        self.stream = stream
        self.tty = stream.isatty() if tty is None else tty
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")

    def write(self, data: bytes) -> None:
        if self.tty:
            data = escape(self._decoder.decode(data)).encode("utf-8", errors="surrogateescape")
        self.stream.write(data)
        self.stream.flush()

    def close(self) -> None:
        """Write what an unfinished character left (as escapes)."""
        if self.tty:
            rest = self._decoder.decode(b"", final=True)
            if rest:
                self.stream.write(escape(rest).encode())
                self.stream.flush()


def field(text: str) -> str:
    """A tenant-chosen name (an image, a label) for a table line on stdout: escaped on a tty."""
    return escape(text) if sys.stdout.isatty() else text
