"""Lazy layer loading (issue 17, part B): a node that holds none of an image starts a sandbox of it after
fetching the chunks it reads, each checked before use; concurrent cold starts fetch each chunk once; a
corrupt chunk fails the create as an environment failure, never a corrupt read; a second cold start
prefetches what the first read. Every check reads what the node fetched (its FUSE process's reports) and
the bytes the sandbox got."""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os

import pytest

import libdsec
from bus import chunks, streams
from bus.images import ImageRegistry
from bus.nodes import set_flag
from tests import ociimages
from tests.conftest import extra_edge
from tests.test_layers import build

pytestmark = pytest.mark.timeout(600)

content, make_root = ociimages.mib_of, ociimages.files_root


@pytest.fixture(scope="module")
async def big(stack, tmp_path_factory):
    """A 1 GiB image of 1,024 files, built and published (whole and in chunks)."""
    root = make_root(tmp_path_factory.mktemp("big") / "root", 1024)
    await build(stack.url, "lazybig", "base", root)
    return (await ImageRegistry(stack.bus).resolve("lazybig"))[0]


@pytest.fixture(scope="module")
async def lazy_node(stack, tmp_path_factory):
    """A node that loads layers lazily, without fetching behind the reads (so what it fetched is what was read)."""
    async with extra_edge(stack, tmp_path_factory.mktemp("lazy"), "k-lazy", 32, lazy_layers=True,
                          lazy_fill=False) as st:
        yield st


@contextlib.asynccontextmanager
async def only_on(stack):
    """Creates go to the other live nodes meanwhile: the session's node is draining."""
    await set_flag(stack.bus, stack.edge.node, draining=True)
    try:
        yield
    finally:
        await set_flag(stack.bus, stack.edge.node, draining=False)


async def test_a_cold_node_starts_after_fetching_a_small_fraction(stack, client, big, lazy_node):
    async with only_on(stack):
        sb = await client.create(image="lazybig", timeout=60)
    try:
        assert sb.node == lazy_node.edge.node
        r = await sb.exec("md5sum /data/f0007 /data/f0900; ls /data | wc -l")
        want = "".join(f"{hashlib.md5(content(i)).hexdigest()}  /data/f{i:04d}\n" for i in (7, 900)) + "1024\n"
        assert r.stdout.decode() == want, r
        lazy = lazy_node.edge.layers.lazy.stats(big.digest)
        assert lazy is not None and not lazy.errors
        fraction = lazy.bytes / big.size
        assert 0 < fraction < 0.10, (lazy.bytes, big.size, lazy.fetched)
        assert lazy_node.edge.layers.bytes_fetched == lazy.bytes   # nothing fetched whole
        assert not (lazy_node.edge.layers.path(big)).exists()       # not whole: fill is off
    finally:
        await sb.destroy()


async def test_concurrent_cold_starts_fetch_each_chunk_once(stack, client, tmp_path, lazy_node):
    await build(stack.url, "lazyconc", "base", make_root(tmp_path / "root", 64))
    layer = (await ImageRegistry(stack.bus).resolve("lazyconc"))[0]
    async with only_on(stack):
        boxes = await asyncio.gather(*(client.create(image="lazyconc", timeout=120) for _ in range(20)))
    try:
        outs = await asyncio.gather(*(sb.exec("md5sum /data/f0031 | cut -c1-32") for sb in boxes))
        assert {o.stdout for o in outs} == {hashlib.md5(content(31)).hexdigest().encode() + b"\n"}
        lazy = lazy_node.edge.layers.lazy.stats(layer.digest)
        assert lazy.counts and max(lazy.counts.values()) == 1, lazy.counts    # no chunk fetched twice
        assert sum(lazy.fetched.values()) == len(lazy.counts) < 64
    finally:
        await asyncio.gather(*(sb.destroy() for sb in boxes), return_exceptions=True)


async def test_a_corrupt_chunk_fails_the_create_never_a_read(stack, client, tmp_path, lazy_node):
    await build(stack.url, "lazybad", "base", make_root(tmp_path / "root", 8))
    layer = (await ImageRegistry(stack.bus).resolve("lazybad"))[0]
    m = await chunks.manifest(stack.bus, layer.digest)
    # the chunk holding the superblock and root directory: every start reads it (put back after: another
    # image's chunk of the same bytes has the same name)
    name = chunks.chunk_name(m.chunks[0])
    good = await stack.bus.obj_get(streams.LAYERS_OBJ, name)
    await stack.bus.obj_put(streams.LAYERS_OBJ, name, os.urandom(m.span(0)[1]))
    try:
        async with only_on(stack):
            with pytest.raises(libdsec.DsecError) as err:
                await client.create(image="lazybad", timeout=10)
        assert isinstance(err.value, (libdsec.EnvironmentFailure, libdsec.CapacityUnavailable)), err.value
        lazy = lazy_node.edge.layers.lazy.stats(layer.digest)
        assert any("does not match the manifest" in e for e in lazy.errors), lazy.errors
        assert 0 not in lazy.counts          # never reported fetched: it was never marked present, nor served
        # elsewhere (the session's node fetches it whole and checks the whole digest) it starts
        async with await client.create(image="lazybad", timeout=30) as sb:
            assert sb.node == stack.edge.node
            assert (await sb.exec("md5sum /data/f0003 | cut -c1-32")).stdout.decode().strip() == \
                hashlib.md5(content(3)).hexdigest()
    finally:
        await stack.bus.obj_put(streams.LAYERS_OBJ, name, good)


async def test_a_chunk_failing_after_the_start_marks_the_exec_it_failed_as_the_environments(stack, client, tmp_path,
                                                                                            lazy_node):
    """A sandbox is running when the chunks it has not read yet go bad: the command reading them gets EIO (never
    a corrupt byte), and its result, exit record, trajectory record and event say environment, with the
    fault; the command's own failure afterwards stays the task's."""
    from tests.test_failure_classes import events_of
    from bus.records import traj_decoder
    from bus import subjects
    await build(stack.url, "lazylate", "base", make_root(tmp_path / "root", 8, salt=b"late"))
    layer = (await ImageRegistry(stack.bus).resolve("lazylate"))[0]
    async with only_on(stack):
        sb = await client.create(image="lazylate", timeout=60)
    m = await chunks.manifest(stack.bus, layer.digest)
    saved: dict[str, bytes] = {}
    try:
        first = await sb.exec("md5sum /data/f0001 | cut -c1-32")
        want = hashlib.md5(content(1, b"late")).hexdigest()
        assert (first.stdout.decode().strip(), first.failure_class) == (want, "")
        held = set(lazy_node.edge.layers.lazy.stats(layer.digest).counts)
        for i, sha in enumerate(m.chunks):   # what it has not read yet goes bad (put back after: shared names)
            if i not in held and chunks.chunk_name(sha) not in saved:
                saved[chunks.chunk_name(sha)] = await stack.bus.obj_get(streams.LAYERS_OBJ, chunks.chunk_name(sha))
                await stack.bus.obj_put(streams.LAYERS_OBJ, chunks.chunk_name(sha), os.urandom(m.span(i)[1]))
        assert saved
        bad = await sb.exec("cat /data/f0005 > /dev/null")
        assert (bad.exit_code, bad.failure_class) == (1, "environment") and b"Input/output error" in bad.stderr, bad
        assert "does not match the manifest" in bad.fault, bad.fault
        own = await sb.exec("exit 3")
        assert (own.exit_code, own.failure_class, own.fault) == (3, "", "")
        evs = await events_of(stack, sb.id, {"environment_failed", "task_failed"})
        kinds = [(e.type, e.failure_class) for e in evs if e.type in ("environment_failed", "task_failed")]
        assert ("environment_failed", "environment") in kinds and kinds[-1] == ("task_failed", "task"), kinds
        trajs: dict = {}
        for _ in range(100):
            timeline = subjects.trajectory("default", "default", sb.id)
            async for d in stack.bus.read_subject(streams.TRAJ_STREAM, timeline):
                t = traj_decoder.decode(d)
                if t.type == "exec":
                    trajs[t.exec_id] = t
            if bad.exec_id in trajs and own.exec_id in trajs:
                break
            await asyncio.sleep(0.05)
        assert trajs[bad.exec_id].failure_class == "environment" and "chunk" in trajs[bad.exec_id].detail
        assert trajs[own.exec_id].failure_class == "task"
    finally:
        await sb.destroy()
        for name, data in saved.items():
            await stack.bus.obj_put(streams.LAYERS_OBJ, name, data)


async def test_a_second_cold_start_prefetches_what_the_first_read(stack, client, tmp_path_factory, big, lazy_node):
    # the first test's run stored its trace (TRACE_AFTER after its first read)
    for _ in range(100):
        order = await chunks.trace(stack.bus, big.digest)
        if order:
            break
        await asyncio.sleep(0.1)
    assert order, "no trace stored"
    async with extra_edge(stack, tmp_path_factory.mktemp("lazy2"), "k-lazy2", 8, lazy_layers=True,
                          lazy_fill=False) as second:
        await set_flag(stack.bus, lazy_node.edge.node, draining=True)
        try:
            async with only_on(stack):
                sb = await client.create(image="lazybig", timeout=60)
            async with sb:
                assert sb.node == "k-lazy2"
                r = await sb.exec("md5sum /data/f0007 | cut -c1-32")
                assert r.stdout.decode().strip() == hashlib.md5(content(7)).hexdigest()
                lazy = second.edge.layers.lazy.stats(big.digest)
                for _ in range(100):                 # the prefetch goes on behind the reads
                    if set(order) <= set(lazy.counts):
                        break
                    await asyncio.sleep(0.05)
                assert set(order) <= set(lazy.counts) and max(lazy.counts.values()) == 1, (order, lazy.counts)
                # what the first run read first came ahead of this run's reads (they waited on it, or found it)
                assert lazy.fetched.get("prefetch", 0) >= len(order) - 1, (lazy.fetched, len(order))
                assert lazy.fetched.get("read", 0) <= 1, lazy.fetched
        finally:
            await set_flag(stack.bus, lazy_node.edge.node, draining=False)


async def test_its_process_killed_mid_fetch_fails_reads_and_the_cache_stays_consistent(stack, client, big,
                                                                                        lazy_node, tmp_path_factory):
    state = tmp_path_factory.mktemp("lazy3")
    await set_flag(stack.bus, lazy_node.edge.node, draining=True)
    try:
        async with extra_edge(stack, state, "k-lazy3", 8, lazy_layers=True, lazy_fill=True) as node:
            async with only_on(stack):
                sb = await client.create(image="lazybig", timeout=60)
            assert sb.node == "k-lazy3"
            lazy = node.edge.layers.lazy.stats(big.digest)
            for _ in range(200):                      # let the fill get going, then kill it mid-way
                if len(lazy.counts) > 40:
                    break
                await asyncio.sleep(0.05)
            assert 40 < len(lazy.counts) < len(big_chunks := (await chunks.manifest(stack.bus, big.digest)).chunks)
            lazy.proc.kill()
            await lazy.proc.wait()
            r = await sb.exec("cat /data/f1023 > /dev/null; echo rc=$?", timeout=20)   # EIO, never a hang
            assert b"rc=0" not in r.stdout, r
            await sb.destroy()
        # the node is gone: nothing of it is left (the leak check after this test), and its cache holds only
        # chunks that match the manifest
        data = next(state.rglob("lazy/*/data"))
        present = (data.parent / "present").read_bytes()
        m = await chunks.manifest(stack.bus, big.digest)
        marked = [i for i, b in enumerate(present) if b]
        assert 40 <= len(marked) < len(big_chunks)
        with open(data, "rb") as f:
            for i in marked:
                off, length = m.span(i)
                f.seek(off)
                assert hashlib.sha256(f.read(length)).hexdigest() == m.chunks[i], i
        # started again on the same state: what it holds is served, not fetched again
        async with extra_edge(stack, state, "k-lazy3", 8, lazy_layers=True, lazy_fill=False) as node:
            async with only_on(stack):
                sb = await client.create(image="lazybig", timeout=60)
            async with sb:
                r = await sb.exec("md5sum /data/f1023 | cut -c1-32")
                assert r.stdout.decode().strip() == hashlib.md5(content(1023)).hexdigest()
                lazy = node.edge.layers.lazy.stats(big.digest)
                assert not set(lazy.counts) & set(marked), "chunks it held were fetched again"
    finally:
        await set_flag(stack.bus, lazy_node.edge.node, draining=False)
