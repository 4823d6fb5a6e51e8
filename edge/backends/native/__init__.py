"""dsec-enter, the small static helper that puts a command into a running sandbox (see dsec-enter.c).

Built from source with the system C compiler by `make setup`, or on first use by the container
backend; without a compiler the zygote falls back to forking itself (about 1 ms slower per exec).
"""
from __future__ import annotations

import os
from pathlib import Path

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dsec-enter.c")
HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dsec-enter")
# The guest side's sources (gVisor builds the agent on the host; VM kinds put all of them on their trusted device)
_HERE = Path(__file__).resolve().parent
AGENT_SOURCE = _HERE / "dsec-agent.c"     # the guest agent
FILES_SOURCE = _HERE / "dsec-files.c"     # the file-tree helper (microvm/files.py)
WATCH_SOURCE = _HERE / "dsec-watch.c"     # the directory-watch helper (microvm/files.py)
BECOME_SOURCE = _HERE / "dsec-become.h"   # included by the agent and the files helper
COMMANDS_SOURCE = _HERE / "dsec-commands.h"   # included by the agent (gVisor's spawner of commands)
GUEST_HEADERS = (BECOME_SOURCE, COMMANDS_SOURCE)   # what a rebuild of the agent follows, beside its source


def available() -> str | None:
    """Path of a built helper that is newer than its source, else None (also when DSEC_ENTER_HELPER=0)."""
    if os.environ.get("DSEC_ENTER_HELPER") == "0":
        return None
    try:
        if os.stat(HELPER).st_mtime >= os.stat(SOURCE).st_mtime and os.access(HELPER, os.X_OK):
            return HELPER
    except OSError:
        pass
    return None


def ensure_built() -> str | None:
    """Build the helper if needed; its path, or None when no compiler can build it."""
    if available():
        return HELPER
    import shutil
    import subprocess
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    tmp = f"{HELPER}.{os.getpid()}.tmp"
    proc = subprocess.run([cc, "-O2", "-static", "-Wall", "-o", tmp, SOURCE], capture_output=True, text=True)
    if proc.returncode != 0:
        if os.path.exists(tmp):
            os.unlink(tmp)
        return None
    os.replace(tmp, HELPER)
    return HELPER
