"""The `dsec` console script. Ctrl-C while the CLI loads (its imports take a few tenths of a second) ends it
as a shell tool ends: exit 130, one line, no traceback (helper U2 saw Python's KeyboardInterrupt trace)."""
from __future__ import annotations

import sys


def main() -> None:
    try:
        from cli.main import main as dsec
    except KeyboardInterrupt:
        sys.stderr.write("dsec: error: interrupted\n")
        sys.exit(130)
    dsec()
