"""The relay never trusts the sandbox: string commands run under the edge's trusted shell (a static
shell bind-mounted read-only at /.dsec), whatever the sandbox did to its own /bin/sh."""
from __future__ import annotations

import asyncio
import os
import socket

import psutil
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
        # the shell, and the empty dir the masked /sys dirs bind (read-only, as all of it)
        assert (await sb.exec(["/bin/busybox", "ls", "/.dsec"])).stdout == b"busybox\nempty\nsh\n"
        assert (await sb.exec(["/bin/busybox", "touch", "/.dsec/empty/x"])).exit_code != 0


async def test_ld_preload_and_profile_do_not_reach_the_trusted_shell(client):
    async with await client.create() as sb:
        await sb.exec(["/bin/busybox", "sh", "-c", "echo 'echo profile-pwned' > /etc/profile; "
                       "echo /tmp/evil.so > /etc/ld.so.preload; export LD_PRELOAD=/tmp/evil.so"])
        r = await sb.exec("echo ok", env={"LD_PRELOAD": "/tmp/evil.so", "ENV": "/etc/profile"})
        assert (r.stdout, r.stderr, r.exit_code) == (b"ok\n", b"", 0)
        r = await sb.exec("echo ok; env | grep -c LD_PRELOAD")   # an export in an earlier exec does not stay
        assert (r.stdout, r.stderr) == (b"ok\n0\n", b"")


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


# A process left behind by one command, spying on every later one: for each process it sees, it
# tries to write into its stdout/stderr through /proc/<pid>/fd, to read its environment and to read
# its stdin, stdout and stderr; what it manages to open it logs with the victim's command line. Its
# own child `sleep 3600` is the control: a process it may open, so the probe is shown to work.
SPY = r"""
sleep 3600 &
while :; do
  for d in /proc/[0-9]*; do
    p=${d#/proc/}; [ "$p" = "$$" ] && continue
    cmd=$(tr '\0' ' ' < $d/cmdline 2>/dev/null)
    case "$cmd" in *proc*|"") continue;; esac
    for n in 1 2; do
      if echo FORGED 2>/dev/null > $d/fd/$n; then echo "wrote $p/$n $cmd" >> /tmp/spy.log; fi
    done
    if cat $d/environ >> /tmp/stolen 2>/dev/null; then echo "environ $p $cmd" >> /tmp/spy.log; fi
    for n in 0 1 2; do
      if timeout 1 cat $d/fd/$n >> /tmp/stolen 2>/dev/null; then echo "read $p/$n $cmd" >> /tmp/spy.log; fi
    done
  done
  touch /tmp/spy.alive
done
"""


async def test_a_process_left_behind_cannot_see_or_alter_later_commands_io(client):
    async with await client.create() as sb:
        await sb.write_file("/tmp/spy.sh", SPY, mode=0o755)
        await sb.exec("/.dsec/sh /tmp/spy.sh > /dev/null 2>&1 &")
        for _ in range(100):   # the spy has made a full pass
            if (await sb.exec("[ -e /tmp/spy.alive ]")).exit_code == 0:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the spy never ran")
        for i in range(3):
            r = await sb.exec(f"sleep 1.5; read answer; echo out-$answer; echo err-$answer >&2; exit {i + 3}",
                              stdin=f"secret{i}\n", env={"TOKEN": f"token{i}"})
            assert (r.stdout, r.stderr, r.exit_code) == (f"out-secret{i}\n".encode(), f"err-secret{i}\n".encode(),
                                                          i + 3)
        spied = (await sb.exec("cat /tmp/spy.log /tmp/stolen 2>/dev/null; true")).stdout
        assert b"secret" not in spied and b"token" not in spied, spied
        # what it could open was its own child only, never a later command
        assert b"read answer" not in spied and b"sleep 1.5" not in spied, spied
        assert b"wrote" in spied and b"sleep 3600" in spied, "the probe could not even open its own child"


async def test_a_sandbox_cannot_reach_the_bus(client, stack):
    """Only its own loopback: neither the nats-server's port nor any address of the host answers."""
    port = int(stack.url.rsplit(":", 1)[1])
    host_ips = sorted({a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                       if a.family == socket.AF_INET})
    async with await client.create() as sb:
        links = (await sb.exec(["/bin/busybox", "ls", "/sys/class/net"])).stdout.split()
        assert links == [b"lo"]
        for ip in host_ips:
            r = await sb.exec(f"nc -w 1 {ip} {port} < /dev/null && echo connected")
            assert r.exit_code != 0 and b"connected" not in r.stdout, (ip, r)


async def test_output_that_looks_like_a_record_is_only_output(client):
    """A command cannot forge its exit: what it prints is data, its exit code is what the kernel reported."""
    fake = b'{"kind":"exit","v":1,"seq":2,"exit_code":0}\n'
    async with await client.create() as sb:
        r = await sb.exec(["/bin/busybox", "sh", "-c", "printf '%s\\n' \"$0\"; exit 7", fake[:-1].decode()])
        assert (r.stdout, r.exit_code) == (fake, 7)


async def test_limits_and_interpreters_come_from_the_relay_not_the_sandbox(client):
    """No core dumps (a leftover process could otherwise raise a later command's limit and make it dump
    its memory), and a script without #! is refused rather than run by the image's (replaceable) /bin/sh."""
    async with await client.create() as sb:
        r = await sb.exec("ulimit -c; ulimit -c unlimited && echo raised; umask")
        assert r.stdout.split()[:1] == [b"0"] and b"raised" not in r.stdout and r.stdout.split()[-1] == b"0022", r
        await sb.write_file("/tmp/noshebang", "echo ran-by-the-image-shell\n", mode=0o755)
        await sb.exec(["/bin/busybox", "sh", "-c", TAMPER])
        with pytest.raises(libdsec.ExecFailed, match="noshebang"):
            await sb.exec(["/tmp/noshebang"])
        with pytest.raises(libdsec.ExecFailed, match="command not found"):
            await sb.exec(["no-such-command"])


async def test_a_command_cannot_make_user_namespaces(client):
    """Each exec needs a user namespace; a sandbox hoarding them could stop every exec on the node."""
    async with await client.create() as sb:
        r = await sb.exec("unshare -U true")
        assert r.exit_code != 0 and b"not permitted" in r.stderr, r
        assert (await sb.exec("sleep 0.1 & wait; echo $?")).stdout == b"0\n"   # fork/clone still work
