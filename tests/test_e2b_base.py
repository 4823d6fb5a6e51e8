"""The E2B base image (issue 18): `dsec image build base --e2b-base` builds E2B's default template, whose
commands run as `user` in /home/user with passwordless sudo that works, and E2B code creates it by default."""
from __future__ import annotations

import asyncio
import os
import sys
import subprocess

import pytest

from edge import e2bbase

pytestmark = pytest.mark.timeout(900)
DSEC = os.path.join(os.path.dirname(sys.executable), "dsec")


def test_the_user_is_added_once_whatever_the_root_had(tmp_path):
    etc = tmp_path / "etc"
    (etc / "skel").mkdir(parents=True)
    (etc / "skel" / ".bashrc").write_text("# bash\n")
    (etc / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\nuser:x:5:5::/old:/bin/sh\n")
    (etc / "shadow").write_text("root:*:19000:0:99999:7:::\n")
    (etc / "group").write_text("root:x:0:\nsudo:x:27:admin\n")
    for _ in range(2):
        e2bbase.add_user(tmp_path)
    assert (etc / "passwd").read_text() == "root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/bash\n"
    assert (etc / "group").read_text() == "root:x:0:\nsudo:x:27:admin,user\nuser:x:1000:\n"
    assert (etc / "shadow").read_text().count("user:*:") == 1
    assert (etc / "sudoers.d" / "user").read_text() == "user ALL=(ALL:ALL) NOPASSWD: ALL\n"
    assert oct((etc / "sudoers.d" / "user").stat().st_mode & 0o777) == "0o440"
    home = tmp_path / "home" / "user"
    assert (home / ".bashrc").read_text() == "# bash\n"
    assert {(p.stat().st_uid, p.stat().st_gid) for p in (home, home / ".bashrc")} == {(1000, 1000)}


async def _base_built(stack) -> None:
    """`dsec image build base --e2b-base` into the session's store, once (again: unchanged, no new version)."""
    p = await asyncio.to_thread(subprocess.run, [DSEC, "image", "build", "--nats", stack.url, "base", "--e2b-base"],
                                capture_output=True, text=True, timeout=800)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("base@")


async def test_e2b_code_gets_the_base_image_its_user_and_sudo(stack, e2b_env):
    await _base_built(stack)
    await asyncio.to_thread(_as_e2b_code)


def _as_e2b_code() -> None:
    from e2b import Sandbox
    sbx = Sandbox.create()                            # no template: E2B's default, DSec's `base`
    try:
        r = sbx.commands.run("whoami; pwd; echo $HOME; id -Gn")
        assert r.stdout.split("\n")[:3] == ["user", "/home/user", "/home/user"] and "sudo" in r.stdout.split("\n")[3]
        assert sbx.commands.run("sudo -n whoami").stdout == "root\n"          # passwordless, and it works
        assert sbx.commands.run("sudo -n touch /etc/made && ls -l /etc/made").exit_code == 0
        assert sbx.commands.run("whoami", user="root").stdout == "root\n"
        tools = sbx.commands.run("bash --version | head -1; python3 -c 'print(6*7)'; pip --version; git --version; "
                                 "curl --version | head -1")
        assert "GNU bash" in tools.stdout and "\n42\n" in tools.stdout and "git version" in tools.stdout, tools.stdout
        imports = sbx.commands.run("python3 -v -c 'import json' 2>&1 | grep json/__init__")
        assert "__init__.cpython-311.pyc matches /usr/lib/python3.11/json/__init__.py" in imports.stdout, \
            imports.stdout   # its .pyc is used: compiled again in every process when the layer lost the mtimes
        sbx.files.write("/home/user/notes.txt", "hi")
        assert sbx.commands.run("cat ~/notes.txt").stdout == "hi"
        # a line of 100,000 bytes under bash -l -c (refused over ~64 KB: the script held it twice), and no
        # variable of the relay's reaches it
        r = sbx.commands.run("echo ${#__dsec_line} " + "a" * 100_000 + " $0")
        assert r.stdout == "0 " + "a" * 100_000 + " /bin/bash\n", r.stdout[:80]
    finally:
        sbx.kill()


async def test_the_example_agent_loop_runs_on_the_facade(stack, e2b_env):
    """examples/e2b_agent_loop.py, E2B code as its users write it, run as a program against this stack."""
    await _base_built(stack)
    example = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                           "e2b_agent_loop.py")
    p = await asyncio.to_thread(subprocess.run, [sys.executable, example], capture_output=True, text=True,
                                timeout=300, env={**os.environ, "DSEC_URL": stack.url})
    assert p.returncode == 0, p.stderr
    assert "turn 1: tests failed\nPASS test_numbers\nFAIL test_words AssertionError\n" in p.stdout
    assert "turn 3: tests pass\nPASS test_numbers\nPASS test_words\n" in p.stdout
    assert "solved on turn 3" in p.stdout
