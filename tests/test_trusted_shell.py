"""The relay never trusts the sandbox: string commands run under the edge's trusted shell (a static
busybox sh bind-mounted read-only at /.dsec), whatever the sandbox did to its own /bin/sh."""
from __future__ import annotations

import os

import pytest

import libdsec

TAMPER = ("rm -f /bin/sh /bin/bash /usr/bin/env; mkdir -p /usr/bin; "
          "printf '#!/bin/busybox sh\\necho pwned\\n' > /bin/sh; chmod 755 /bin/sh; "
          "cp /bin/sh /bin/bash; cp /bin/sh /usr/bin/env; echo 'echo profile-pwned' > /etc/profile; echo done")


async def test_overwritten_shells_do_not_change_what_a_string_command_runs(client):
    async with await client.create() as sb:
        assert (await sb.exec(["/bin/busybox", "sh", "-c", TAMPER])).stdout == b"done\n"
        tampered = await sb.exec(["/bin/sh", "-c", "echo hi"])       # the image's own shell: replaced
        assert tampered.stdout == b"pwned\n"
        r = await sb.exec("echo hi; echo err >&2; exit 3")          # a string command: the trusted shell
        assert (r.stdout, r.stderr, r.exit_code) == (b"hi\n", b"err\n", 3)
        lines = [ev async for ev in sb.stream("echo a; echo b")]
        assert [o.data for o in lines if isinstance(o, libdsec.Output)] == [b"a\n", b"b\n"]


async def test_the_trusted_shell_cannot_be_replaced_moved_or_covered(client):
    async with await client.create() as sb:
        for argv in (["/bin/busybox", "sh", "-c", "echo x > /.dsec/sh"],
                     ["/bin/busybox", "cp", "/bin/busybox", "/.dsec/sh"],
                     ["/bin/busybox", "rm", "-f", "/.dsec/sh"],
                     ["/bin/busybox", "mv", "/.dsec", "/elsewhere"],
                     ["/bin/busybox", "rmdir", "/.dsec"],
                     ["/bin/busybox", "umount", "/.dsec"],
                     ["/bin/busybox", "mount", "-t", "tmpfs", "none", "/.dsec"],
                     ["/bin/busybox", "mount", "--bind", "/bin", "/.dsec"]):
            r = await sb.exec(argv)
            assert r.exit_code != 0, (argv, r)
        assert (await sb.exec("echo still")).stdout == b"still\n"
        assert (await sb.exec(["/bin/busybox", "ls", "/.dsec"])).stdout == b"sh\n"


async def test_ld_preload_and_profile_do_not_reach_the_trusted_shell(client):
    async with await client.create() as sb:
        await sb.exec(["/bin/busybox", "sh", "-c", "echo 'echo profile-pwned' > /etc/profile"])
        r = await sb.exec("echo ok", env={"LD_PRELOAD": "/tmp/evil.so", "ENV": "/etc/profile"})
        assert (r.stdout, r.stderr, r.exit_code) == (b"ok\n", b"", 0)


async def test_a_commands_environment_is_the_request_and_the_spec_only(client):
    os.environ["DSEC_EDGE_SECRET"] = "edge-only"    # in the edge's own process (the session stack runs here)
    try:
        async with await client.create(env={"FROM_SPEC": "s"}) as sb:
            out = (await sb.exec(["/bin/busybox", "env"], env={"FROM_REQUEST": "r"})).stdout.decode()
    finally:
        del os.environ["DSEC_EDGE_SECRET"]
    names = {line.split("=", 1)[0] for line in out.splitlines()}
    assert names == {"PATH", "HOME", "FROM_SPEC", "FROM_REQUEST"}, out


async def test_a_string_command_with_a_nul_byte_is_refused(client):
    async with await client.create() as sb:
        with pytest.raises(libdsec.InvalidRequest):
            await sb.exec("echo a\0b")
