"""sb.files (issue 18): the file tree of a sandbox and files of any size, resolved inside its root."""
from __future__ import annotations

import asyncio
import hashlib
import os

import pytest

import libdsec

pytestmark = pytest.mark.timeout(300)


async def test_a_100_mib_file_goes_in_and_out_byte_exact(client):
    """No 700 kB limit: 100 MiB of random bytes written in pieces, read back whole and by the sandbox."""
    data = os.urandom(100 << 20)
    async with await client.create(resources=libdsec.Resources(memory="512Mi", disk="1Gi")) as sb:
        await sb.files.make_dir("/data")
        await sb.files.write("/data/big.bin", data, mode=0o600)
        inside = (await sb.exec("sha256sum /data/big.bin; stat -c '%s %a %u' /data/big.bin")).stdout.decode()
        assert inside.split()[0] == hashlib.sha256(data).hexdigest(), inside
        assert inside.split()[2:] == [str(len(data)), "600", "0"], inside
        assert await sb.files.read("/data/big.bin") == data
        await sb.files.write("/data/empty", b"")
        assert await sb.files.read("/data/empty") == b""


async def test_a_write_is_whole_or_not_at_all(client):
    """A write past the disk's quota returned success with the file shorter than the data (its last piece's
    short write went unchecked), and two writes of one path at once left a mix of both with one of them
    reported a success. Now a write either puts all its bytes or fails saying why and leaves the path as it
    was, and a reader or another writer never sees part of one."""
    async with await client.create(resources=libdsec.Resources(memory="512Mi", disk="64Mi")) as sb:
        await sb.files.write("/kept", b"before")
        with pytest.raises(libdsec.FileOpError, match="disk quota exceeded") as ei:
            await sb.files.write("/kept", os.urandom(64 << 20))
        assert str(ei.value).endswith(": /kept"), ei.value   # the path written, not the hidden file's name
        assert await sb.files.read("/kept") == b"before"
        assert (await sb.exec("ls -a / | grep -c dsec-w")).stdout == b"0\n"   # no partial file left
        before = b"first"
        await sb.files.write("/same", before)
        for size in (3 << 20, 8 << 20):
            a, b = b"A" * size, b"B" * (size - 12345)
            got = await asyncio.gather(sb.files.write("/same", a), sb.files.write("/same", b),
                                       sb.files.read("/same"), return_exceptions=True)
            assert got[0] is None and got[1] is None, got[:2]
            if isinstance(got[2], libdsec.FileOpError):           # replaced under it: said so
                assert "changed while read" in str(got[2]), got[2]
            else:                                                 # what was there, or one write whole
                assert got[2] in (before, a, b), len(got[2])
            before = await sb.files.read("/same")
            assert before in (a, b)
        big = os.urandom(1 << 20)         # through a symlink: its target is written, the link stays one
        await sb.exec("mkdir -p /data && echo old > /data/real && ln -s /data/real /link")
        await sb.files.write("/link", big)
        assert await sb.files.read("/data/real") == big
        assert (await sb.files.get_info("/link")).type == "symlink"


async def test_a_name_that_is_not_utf8_is_listed_and_watched_escaped(client):
    """A file whose name holds a byte that is no UTF-8 (made inside the sandbox) broke every listing of its
    directory ("FileOp failed on the node: UnicodeEncodeError") and ended a watch of it, losing its events.
    Such a byte is now written as \\xNN; the rest of the listing and the watch go on."""
    async with await client.create() as sb:
        await sb.exec("mkdir /w && touch /w/ok")
        w = await sb.files.watch("/w")
        try:
            await sb.exec("touch /w/$(printf 'bad\\377') /w/after; sleep 0.2; touch /w/last")
            seen = []

            async def read() -> None:
                async for ev in w.events():
                    seen.append((ev.type, ev.name))
                    if ev.name == "last":
                        return
            await asyncio.wait_for(read(), 10)
            assert ("create", "bad\\xff") in seen and ("create", "after") in seen, seen
        finally:
            await w.stop()
            await w.close()
        names = sorted(e.name for e in await sb.files.list("/w"))
        assert names == ["after", "bad\\xff", "last", "ok"], names
        assert {e.path for e in await sb.files.list("/", depth=2)} >= {"/w/bad\\xff", "/w/ok"}
        # the name as Python decodes it (surrogateescape) is refused typed (helper F2: UnicodeEncodeError)
        with pytest.raises(libdsec.InvalidRequest, match="not valid UTF-8 text"):
            await sb.files.get_info("/w/bad\udcff")
        with pytest.raises(libdsec.InvalidRequest, match="not valid UTF-8 text"):
            await sb.exec(["cat", "/w/bad\udcff"])


async def test_tree_operations_and_what_they_return(client):
    async with await client.create() as sb:
        root = await sb.files.get_info("/")
        assert (root.name, root.path, root.type, root.uid) == ("/", "/", "dir", 0), root
        assert await sb.files.make_dir("/w/a/b") is True
        assert await sb.files.make_dir("/w/a/b") is False
        await sb.files.write("/w/a/f.txt", "hello")
        assert (await sb.exec("ln -s f.txt /w/a/link && chmod 640 /w/a/f.txt")).exit_code == 0
        info = await sb.files.get_info("/w/a/f.txt")
        assert (info.name, info.path, info.type, info.size, info.permissions, info.uid, info.gid) == \
            ("f.txt", "/w/a/f.txt", "file", 5, "rw-r-----", 0, 0), info
        link = await sb.files.get_info("/w/a/link")
        assert (link.type, link.symlink_target) == ("symlink", "f.txt"), link
        assert [e.path for e in await sb.files.list("/w")] == ["/w/a"]
        assert [(e.path, e.type) for e in await sb.files.list("/w", depth=3)] == [
            ("/w/a", "dir"), ("/w/a/b", "dir"), ("/w/a/f.txt", "file"), ("/w/a/link", "symlink")]
        moved = await sb.files.rename("/w/a/f.txt", "/w/g.txt")
        assert (moved.path, moved.size) == ("/w/g.txt", 5)
        assert await sb.files.exists("/w/g.txt") and not await sb.files.exists("/w/a/f.txt")
        assert await sb.files.exists("/w/a/link")   # dangling now: still there
        await sb.files.remove("/w/a")
        assert [e.path for e in await sb.files.list("/w")] == ["/w/g.txt"]
        assert (await sb.exec("cat /w/g.txt")).stdout == b"hello"


async def test_a_listing_of_entries_with_large_metadata_comes_in_pages_that_fit_the_bus(client):
    """150 files, each with 32 KiB of metadata: 4.8 MB of entries, far past a bus message (1 MiB) though far
    below a page's count. The answer could not be sent, and the call waited out its timeout. Pages are cut
    by their size too now; a listing comes whole."""
    meta = {f"k{i}": str(i) * 4000 for i in range(8)}
    async with await client.create(resources=libdsec.Resources(disk="1Gi")) as sb:
        await sb.files.make_dir("/m")
        await asyncio.gather(*(sb.files.write(f"/m/f{i:03}", "x", metadata=meta) for i in range(150)))
        found = await sb.files.list("/m", timeout=10)
        assert [e.name for e in found] == [f"f{i:03}" for i in range(150)]
        assert all(e.metadata == meta for e in found)


async def test_metadata_is_kept_as_user_xattrs(client):
    async with await client.create() as sb:
        await sb.files.write("/m.txt", "x", metadata={"owner": "agent-7", "step": "12"})
        info = await sb.files.get_info("/m.txt")
        assert info.metadata == {"owner": "agent-7", "step": "12"}
        assert [e.metadata for e in await sb.files.list("/") if e.path == "/m.txt"] == [info.metadata]
        await sb.files.write("/m.txt", "y", metadata={"step": "13"})   # a rewrite's metadata replaces the old
        assert (await sb.files.get_info("/m.txt")).metadata == {"step": "13"}
        await sb.files.write("/m.txt", "z")                               # none: none left
        assert (await sb.files.get_info("/m.txt")).metadata == {}
        with pytest.raises(libdsec.InvalidRequest, match="metadata"):
            await sb.files.write("/n.txt", "x", metadata={"": "v"})
        with pytest.raises(libdsec.InvalidRequest, match="metadata"):
            await sb.files.write("/n.txt", "x", metadata={"k": "v" * 5000})
        assert not await sb.files.exists("/n.txt")


async def test_bad_paths_get_one_clear_line_and_the_sandbox_stays_well(client):
    async with await client.create() as sb:
        with pytest.raises(libdsec.InvalidRequest, match="absolute"):
            await sb.files.list("tmp")
        with pytest.raises(libdsec.FileOpError, match="no such file: /nope"):
            await sb.files.get_info("/nope")
        with pytest.raises(libdsec.FileOpError, match="no such file"):
            await sb.files.read("/nope/x")
        with pytest.raises(libdsec.FileOpError, match="root itself"):
            await sb.files.remove("/")
        with pytest.raises(libdsec.FileOpError, match="not a directory"):
            await sb.files.make_dir("/etc/passwd/x")
        with pytest.raises(libdsec.FileOpError, match="not a directory"):
            await sb.files.list("/etc/passwd")
        with pytest.raises(libdsec.InvalidRequest, match="depth"):
            await sb.files.list("/", depth=0)
        assert not await sb.files.exists("/nope/deeper")
        # a rename names what is missing (it said "no such directory: /tmp" for a missing file in /tmp)
        with pytest.raises(libdsec.FileOpError, match="no such file: /tmp/nope$"):
            await sb.files.rename("/tmp/nope", "/tmp/q")
        await sb.files.write("/tmp/here", b"x")
        with pytest.raises(libdsec.FileOpError, match="no such directory: /nowhere$"):
            await sb.files.rename("/tmp/here", "/nowhere/q")
        # a mode is permission bits: -1 made the file 7777 (setuid, setgid, sticky), 2**40 made it 000
        for mode in (-1, 0o17777, 2 ** 40, True):
            with pytest.raises(libdsec.InvalidRequest, match="0 to 0o7777"):
                await sb.files.write("/tmp/m", b"x", mode=mode)
            with pytest.raises(libdsec.InvalidRequest, match="0 to 0o7777"):
                await sb.write_file("/tmp/m", b"x", mode=mode)
        assert (await sb.exec("echo ok")).stdout == b"ok\n"


async def test_planted_symlinks_never_lead_out_of_the_root(client, tmp_path):
    """The attack from inside: links to / , to the host's files through /proc and out of the tree; every
    operation through them stays in the sandbox (the host file is untouched, the link itself is removed)."""
    canary = tmp_path / "canary"
    canary.write_text("host")
    async with await client.create() as sb:
        r = await sb.exec(f"mkdir -p /t && ln -s / /t/root && ln -s /proc/1/root{tmp_path} /t/host && "
                          f"ln -s ../../../../..{tmp_path} /t/up && mkdir -p {tmp_path} && echo mine > {canary}")
        assert r.exit_code == 0, r.stderr
        await sb.files.write("/t/up/canary", "written")          # resolves to the sandbox's own copy
        assert canary.read_text() == "host"
        assert (await sb.exec(f"cat {canary}")).stdout == b"written"
        with pytest.raises(libdsec.FileOpError):
            await sb.files.list("/t/host")                        # a magic link: refused
        await sb.files.remove("/t/up/canary")
        assert canary.read_text() == "host"
        await sb.files.make_dir("/t/root/made")                    # the sandbox's /made
        assert not os.path.exists("/made") and await sb.files.exists("/made")
        await sb.files.remove("/t/root")                           # the link, not the root
        assert (await sb.exec("ls /etc/passwd")).exit_code == 0
        await sb.files.rename("/t/up", "/t/moved")
        assert canary.read_text() == "host" and tmp_path.exists()


async def test_file_ops_as_a_user_are_checked_as_it_and_make_its_files(client):
    """user=: permissions checked as that user of the sandbox (its root's files refused), and what it writes or
    makes is its own (0644 files, 0755 directories); the default is the sandbox's root, as before."""
    async with await client.create() as sb:
        await sb.exec("mkdir -p /home/u && chown 1000:1000 /home/u && echo secret > /root/s && chmod 600 /root/s "
                      "&& chmod 700 /root")
        await sb.files.write("/home/u/a.txt", "mine", user="1000:1000")
        assert await sb.files.make_dir("/home/u/d/e", user="1000:1000") is True
        seen = await sb.exec("stat -c '%n %u:%g %a' /home/u/a.txt /home/u/d /home/u/d/e")
        assert seen.stdout.decode().splitlines() == ["/home/u/a.txt 1000:1000 644", "/home/u/d 1000:1000 755",
                                                     "/home/u/d/e 1000:1000 755"]
        for attempt in (sb.files.read("/root/s", user="1000:1000"), sb.files.write("/etc/passwd", "x", user="1000:1000"),
                        sb.files.remove("/root/s", user="1000:1000"), sb.files.make_dir("/etc/new", user="1000:1000"),
                        sb.files.list("/root", user="1000:1000")):
            with pytest.raises(libdsec.FileOpError, match="permission denied"):
                await attempt
        assert await sb.files.read("/root/s") == b"secret\n"                 # its root may
        assert (await sb.files.get_info("/home/u/a.txt", user="1000:1000")).size == 4
        with pytest.raises(libdsec.InvalidRequest, match="nobody-here"):
            await sb.files.read("/root/s", user="nobody-here")
        assert (await sb.exec("cat /etc/passwd | head -1")).stdout.startswith(b"root:")   # untouched


async def test_a_caller_that_does_not_page_is_refused_past_one_page_not_given_a_short_listing(client):
    """An SDK from before pages ignores `next`: past a page it would get the first 2,000 entries as if they
    were all (review R). It is refused, as it was past its limit before."""
    async with await client.create() as sb:
        assert (await sb.exec("mkdir /d && cd /d && seq 2100 | xargs touch")).exit_code == 0
        with pytest.raises(libdsec.FileOpError, match="use an SDK that pages"):
            await sb.files._op("list", "/d", depth=1)              # (the request an older SDK sends)
        assert len(await sb.files.list("/d")) == 2100
