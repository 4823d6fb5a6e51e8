"""sb.files.watch (issue 18, E2B's watch_dir): a directory's changes streamed as they happen, from the edge's
inotify on the directory resolved inside the sandbox's root."""
from __future__ import annotations

import asyncio
import contextlib

import pytest

import libdsec
from edge.backends import watcher

pytestmark = pytest.mark.timeout(120)


async def _take(w, n: int, within: float = 10.0) -> list[tuple[str, str]]:
    """The next n events of a watch."""
    got: list[tuple[str, str]] = []

    async def read() -> None:
        async for ev in w.events():
            got.append((ev.type, ev.name))
            if len(got) == n:
                return
    try:
        await asyncio.wait_for(read(), within)
    except asyncio.TimeoutError:
        raise AssertionError(f"{len(got)} of {n} events within {within}s: {got}") from None
    return got


class Seen(list):
    """Every event of a watch, as (type, name), read as it comes; end() stops the watch, waits for the reader
    and closes the watch."""

    def __init__(self, w) -> None:
        super().__init__()
        self.w = w
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        async for ev in self.w.events():
            self.append((ev.type, ev.name))

    async def end(self) -> None:
        await self.w.stop()
        await asyncio.wait_for(self._reader, 10)
        await self.w.close()


@contextlib.asynccontextmanager
async def recursive_watch(client, path: str):
    """A fresh sandbox with directory `path` made, and a recursive watch of it: (sandbox, Seen)."""
    async with await client.create() as sb:
        await sb.exec(f"mkdir {path}")
        seen = Seen(await sb.files.watch(path, recursive=True))
        try:
            yield sb, seen
        finally:
            await seen.end()


async def test_a_watch_streams_each_change_as_it_happens(client):
    async with await client.create() as sb:
        await sb.exec("mkdir -p /w/d")
        w = await sb.files.watch("/w")
        try:
            await sb.exec("echo x > /w/a")
            assert await _take(w, 2) == [("create", "a"), ("write", "a")]
            await sb.exec("chmod 600 /w/a; mv /w/a /w/b; rm /w/b; echo y > /w/d/deeper; mkdir /w/e")
            assert await _take(w, 5) == [("chmod", "a"), ("rename", "a"), ("create", "b"), ("remove", "b"),
                                         ("create", "e")]          # /w/d/deeper: not recursive, not seen
            assert await sb.processes() == []                       # a watch is no process of the sandbox
        finally:
            await w.stop()
        assert [e async for e in w.events()] == []                 # it ended
        await w.close()
    assert watcher._running == 0


async def test_a_recursive_watch_follows_new_directories_but_no_symlink(client, tmp_path):
    """Planted symlinks (to its /, its /tmp, and a path that is a directory on the host) are not followed:
    nothing happening there, or in the host's directory, is reported."""
    async with await client.create() as sb:
        await sb.exec(f"mkdir -p /r/sub; ln -s / /r/up; ln -s /tmp /r/tmp; ln -s {tmp_path} /r/host")
        with pytest.raises(libdsec.FileOpError, match="no such directory"):   # resolved in its root: none there
            await sb.files.watch("/r/host")
        w = await sb.files.watch("/r", recursive=True)
        try:
            await sb.exec("echo 1 > /r/sub/f; mkdir /r/new")
            assert await _take(w, 3) == [("create", "sub/f"), ("write", "sub/f"), ("create", "new")]
            (tmp_path / "from-the-host").write_text("x")
            await sb.exec("echo 2 > /r/new/g; touch /zz /tmp/zz; rm -r /r/sub")   # through the symlinks: nothing
            assert await _take(w, 4) == [("create", "new/g"), ("write", "new/g"), ("remove", "sub/f"),
                                         ("remove", "sub")]
        finally:
            await w.stop()
            await w.close()


async def test_what_a_new_directory_holds_before_its_watch_is_added_is_reported_once(client):
    """mkdir -p and files made in the same breath as their directory: made before the edge could add the new
    directory's watch, they are reported as created when it is added; never missed, never twice."""
    async with recursive_watch(client, "/n") as (sb, seen):
        for i in range(8):
            made = [f"{i}", f"{i}/b", f"{i}/b/c", f"{i}/b/c/f", f"{i}/b/g", f"{i}/h"]
            await sb.exec(f"cd /n && mkdir -p {i}/b/c && echo x > {i}/b/c/f && touch {i}/b/g {i}/h")
            await seen.w.flush()
            created = sorted(name for kind, name in seen if kind == "create" and name.split("/")[0] == f"{i}")
            assert created == sorted(made), seen
        await sb.exec("echo y > /n/0/b/c/later")   # the dirs found by the listing are watched too
        await seen.w.flush()
        assert ("create", "0/b/c/later") in seen, seen


async def test_watching_what_is_no_directory_is_a_clear_error(client):
    async with await client.create() as sb:
        await sb.exec("echo f > /file")
        for path, why in (("/nope", "no such directory: /nope"), ("/file", "not a directory: /file")):
            with pytest.raises(libdsec.FileOpError, match=why):
                await sb.files.watch(path)
        with pytest.raises(libdsec.InvalidRequest, match="absolute"):
            await sb.files.watch("relative")
        assert (await sb.exec("echo fine")).stdout == b"fine\n"


async def test_a_watch_ends_with_its_directory_or_its_sandbox(client, caplog):
    import gc
    sb = await client.create()
    await sb.exec("mkdir /gone /kept")
    gone = await sb.files.watch("/gone")
    kept = await sb.files.watch("/kept")
    await sb.exec("rmdir /gone")
    assert await _take(gone, 1) == [("remove", "")]
    assert [e async for e in gone.events()] == []
    await gone.close()
    await sb.destroy()
    with pytest.raises(libdsec.SandboxNotFound):
        [e async for e in kept.events()]
    await kept.close()
    for _ in range(50):
        if watcher._running == 0:
            break
        await asyncio.sleep(0.1)
    assert watcher._running == 0
    other = await client.create(ttl=30)
    await other.exec("mkdir /w")
    timed = await other.files.watch("/w", timeout=1)
    await asyncio.sleep(1.5)    # its timeout ends it, cancelling its reader
    await timed.close()
    await other.destroy()
    gc.collect()
    await asyncio.sleep(0.1)
    left = [t for t in asyncio.all_tasks() if "wait_fd" in repr(t.get_coro())]   # (the stack runs in this loop)
    assert not left and not [r for r in caplog.records if "destroyed but it is pending" in r.getMessage()], left



async def test_a_deep_tree_is_watched_to_its_bottom(client):
    """1,200 levels (past Python's recursion limit): the walk is no recursion."""
    deep = "/".join(["a"] * 1200)
    async with await client.create() as sb:
        await sb.exec(f"mkdir -p /t/{deep}")
        w = await sb.files.watch("/t", recursive=True)
        try:
            await sb.exec(f"cd /t/{deep} && echo x > bottom")
            assert await _take(w, 2) == [("create", f"{deep}/bottom"), ("write", f"{deep}/bottom")]
        finally:
            await w.stop()
            await w.close()


async def test_flush_returns_once_every_earlier_change_is_out(client):
    """flush(): the edge reads what inotify holds, then a mark comes back; events() holds all changes made
    before it. A file written by files.write shows as create, write, chmod (no separate truncation)."""
    async with await client.create() as sb:
        await sb.exec("mkdir /f && chown 1000:1000 /f")
        w = await sb.files.watch("/f")
        seen = Seen(w)
        try:
            for n in range(1, 6):   # as a user: what it makes is its own already (no chown, no chmod for it)
                await sb.files.write(f"/f/{n}.txt", "x" * n, user="1000:1000")
                await w.flush()
                assert seen[-3:] == [("create", f"{n}.txt"), ("write", f"{n}.txt"), ("chmod", f"{n}.txt")], seen
        finally:
            await seen.end()


async def test_a_moved_directorys_files_are_reported_under_its_new_path_never_its_old(client):
    """Helper F2: a recursive watch reported files of a directory moved twice in a row under its first path
    (the second move came before the watch looked at the first), and files of one moved out of the watched
    tree under the path it had in it. A move within the tree renames what the watch follows; one out of it
    ends there."""
    async with recursive_watch(client, "/m") as (sb, seen):
        for i in range(10):
            await sb.exec(f"mkdir -p /m/a{i}/sub && echo 0 > /m/a{i}/sub/keep")
            await seen.w.flush()
            seen.clear()
            await sb.exec(f"mv /m/a{i} /m/b{i} && echo 1 > /m/b{i}/sub/f && mv /m/b{i} /m/c{i} && "
                          f"echo 2 > /m/c{i}/sub/g && mv /m/c{i} /tmp/out{i} && echo 3 > /tmp/out{i}/sub/h")
            await seen.w.flush()
            names = [name for _, name in seen]
            assert ("create", f"b{i}/sub/f") in seen and ("create", f"c{i}/sub/g") in seen, seen
            assert not [n for n in names if n.startswith((f"a{i}/", f"b{i}/sub/g", f"c{i}/sub/h"))], seen
            assert ("rename", f"c{i}") in seen, seen   # moved out: its end is said, then nothing of it
