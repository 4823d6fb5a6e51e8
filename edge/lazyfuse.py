"""One lazily loaded layer: a FUSE filesystem (pyfuse3, a process of its own, never the edge's event loop)
holding one file, layer.erofs, whose bytes come from the layer's chunks (bus/chunks.py) as they are first
read. The kernel's EROFS driver mounts that file like a local one (file-backed mount); each read of a chunk
not here yet fetches it from the object store once (concurrent readers wait for the same fetch), checks it
against the manifest's sha256 before a byte of it is served, writes it into the node's cache file and
marks it present (a byte per chunk in `present`, written after the data: a restart trusts what it marks).

A chunk that cannot be fetched or does not match fails the read with EIO, never a corrupt byte; if this
process dies, the kernel fails every read of the file (EIO), it never hangs. It tells the edge on stdout, one
JSON object a line: {"ready"}, {"fetched": i, "bytes": n, "why": "read"|"prefetch"|"fill"}, {"error": ...},
{"complete": true} (every chunk here and the whole file matches the layer's digest: the edge then mounts the
local file directly for later sandboxes). It records the order its reads first needed chunks in and stores
it once as the layer's trace (the next cold start fetches those first: --prefetch).

  python -m edge.lazyfuse --dir DIR --manifest FILE --nats URL [--creds FILE] [--prefetch I,J,...] [--fill]
  DIR: data (the cache file), present, mnt/ (the mountpoint), faults (a line per chunk that could not be
  served, "<time.monotonic()> <why>", written before the read gets EIO; edge/lazylayers.py reads it).
"""
from __future__ import annotations

import argparse
import asyncio
import errno
import hashlib
import json
import os
import signal
import stat
import sys
import threading
import time
from pathlib import Path

import pyfuse3
import trio

from bus import chunks, streams
from bus.conn import Bus
from bus.errors import BusError

FILE_INODE = pyfuse3.ROOT_INODE + 1
FAULTS = "faults"        # (see DIR above)
FAULTS_MAX = 64 << 10
NAME = b"layer.erofs"
FETCH_TIMEOUT = 30.0
FILL_CONCURRENCY = 4
TRACE_AFTER = 3.0        # seconds after the first read its trace is stored (if none is yet)


def say(**fields) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


class Fetcher:
    """The NATS side, on a thread of its own with its own asyncio loop (pyfuse3 runs on trio)."""

    def __init__(self, url: str, creds: str | None) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="chunk-fetch", daemon=True)
        self.thread.start()
        self.bus: Bus = self._run(Bus.connect(url, name="dsec-lazy", creds=creds), 10.0)

    def _run(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def get(self, name: str) -> bytes:
        return self._run(self.bus.obj_get(streams.LAYERS_OBJ, name), FETCH_TIMEOUT)

    def put_trace(self, digest: str, order: list[int]) -> None:
        async def put() -> None:
            if not await self.bus.obj_has(streams.LAYERS_OBJ, chunks.trace_name(digest)):
                await self.bus.obj_put(streams.LAYERS_OBJ, chunks.trace_name(digest), json.dumps(order).encode())
        self._run(put(), FETCH_TIMEOUT)


class LazyLayer(pyfuse3.Operations):
    def __init__(self, directory: Path, manifest: chunks.ChunkManifest, fetcher: Fetcher) -> None:
        super().__init__()
        self.m = manifest
        self.fetcher = fetcher
        n = len(manifest.chunks)
        self.data = os.open(directory / "data", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.faults = os.open(directory / FAULTS, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC,
                              0o600)
        os.ftruncate(self.data, manifest.size)
        self.present_fd = os.open(directory / "present", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        have = os.pread(self.present_fd, n, 0)
        if len(have) < n:
            os.ftruncate(self.present_fd, n)
            have = have + bytes(n - len(have))
        self.present = bytearray(have)
        self.inflight: dict[int, trio.Event] = {}
        self.failed: dict[int, str] = {}
        self.order: list[int] = []          # chunks in the order reads first needed them
        self.seen: set[int] = set()
        self.first_read = 0.0
        self.trace_stored = False
        self.completed = False

    # ------------------------------------------------------------------ chunks

    async def ensure(self, i: int, why: str) -> None:
        """Chunk i here and checked, fetching it once; FUSEError(EIO) if it cannot be."""
        if self.present[i]:
            return
        ev = self.inflight.get(i)
        if ev is None:
            ev = self.inflight[i] = trio.Event()
            try:
                await trio.to_thread.run_sync(self._fetch, i, why)
            except Exception as exc:    # noqa: BLE001  (any failure is this chunk's: EIO to the reader)
                self.failed[i] = str(exc) or type(exc).__name__
                self._fault(f"chunk {i}: {self.failed[i]}")
            finally:
                del self.inflight[i]
                ev.set()
        else:
            await ev.wait()
        if not self.present[i]:
            raise pyfuse3.FUSEError(errno.EIO)

    def _fault(self, text: str) -> None:
        """A chunk that cannot be served: told to the edge, and written to the faults file, with its
        CLOCK_MONOTONIC time, before the read gets EIO (so an exec that failed by it, ending after, finds it)."""
        say(error=text)
        if os.fstat(self.faults).st_size > FAULTS_MAX:
            os.ftruncate(self.faults, 0)
        os.write(self.faults, f"{time.monotonic():.6f} {text}\n".encode()[:4096])

    def _fetch(self, i: int, why: str) -> None:
        sha = self.m.chunks[i]
        try:
            data = self.fetcher.get(chunks.chunk_name(sha))
        except (BusError, TimeoutError, OSError) as exc:
            raise OSError(f"fetch failed: {exc}") from exc
        off, length = self.m.span(i)
        if len(data) != length or hashlib.sha256(data).hexdigest() != sha:
            raise OSError(f"chunk {sha[:12]} does not match the manifest (corrupt)")
        view = memoryview(data)
        while view:
            view = view[os.pwrite(self.data, view, off + length - len(view)):]
        os.fdatasync(self.data)             # the data, then its mark: a restart never trusts a torn chunk
        os.pwrite(self.present_fd, b"\x01", i)
        self.present[i] = 1
        say(fetched=i, bytes=length, why=why)

    async def complete_if_done(self) -> None:
        if self.completed or not all(self.present):
            return
        self.completed = True
        digest = await trio.to_thread.run_sync(_file_digest, self.data)
        if digest == self.m.layer:
            say(complete=True)
        else:
            say(error=f"the whole file does not match {self.m.layer}")

    # ------------------------------------------------------------------ FUSE

    def _attr(self, inode: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = inode
        if inode == pyfuse3.ROOT_INODE:
            a.st_mode, a.st_size, a.st_nlink = stat.S_IFDIR | 0o555, 0, 2
        else:
            a.st_mode, a.st_size, a.st_nlink = stat.S_IFREG | 0o444, self.m.size, 1
        a.st_uid = a.st_gid = 0
        a.st_blksize = 4096
        a.st_blocks = (a.st_size + 511) // 512
        a.entry_timeout = a.attr_timeout = 3600
        return a

    async def getattr(self, inode, ctx=None):
        if inode not in (pyfuse3.ROOT_INODE, FILE_INODE):
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(inode)

    async def lookup(self, parent_inode, name, ctx=None):
        if parent_inode != pyfuse3.ROOT_INODE or name != NAME:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(FILE_INODE)

    async def opendir(self, inode, ctx):
        if inode != pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    async def readdir(self, fh, start_id, token):
        if start_id == 0:
            pyfuse3.readdir_reply(token, NAME, self._attr(FILE_INODE), 1)

    async def open(self, inode, flags, ctx):
        if inode != FILE_INODE:
            raise pyfuse3.FUSEError(errno.EISDIR)
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise pyfuse3.FUSEError(errno.EROFS)
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    async def read(self, fh, off, size):
        if off >= self.m.size:
            return b""
        size = min(size, self.m.size - off)
        first, last = off // self.m.chunk_size, (off + size - 1) // self.m.chunk_size
        for i in range(first, last + 1):
            if i not in self.seen:
                self.seen.add(i)
                self.order.append(i)
                self.first_read = self.first_read or time.monotonic()
            await self.ensure(i, "read")
        await self.complete_if_done()
        return os.pread(self.data, size, off)

    async def trace_later(self) -> None:
        """Store the order of the first reads once they settled (TRACE_AFTER after the first; or at a stop
        before that: store_trace)."""
        while not self.first_read:
            await trio.sleep(0.2)
        await trio.sleep(TRACE_AFTER)
        await self.store_trace()

    async def store_trace(self) -> None:
        order = self.order[:chunks.TRACE_MAX]
        if order and not self.trace_stored:
            self.trace_stored = True
            try:
                await trio.to_thread.run_sync(self.fetcher.put_trace, self.m.layer, order)
            except Exception as exc:   # noqa: BLE001  (a trace is a hint: losing it costs a prefetch)
                say(error=f"trace not stored: {exc}")

    async def background(self, prefetch: list[int], fill: bool) -> None:
        """Fetch the traced chunks first, then (fill) every other, a few at a time."""
        for i in prefetch:
            if 0 <= i < len(self.m.chunks):
                try:
                    await self.ensure(i, "prefetch")
                except pyfuse3.FUSEError:
                    pass
        if fill:
            todo = [i for i in range(len(self.m.chunks)) if not self.present[i]]
            limiter = trio.CapacityLimiter(FILL_CONCURRENCY)

            async def one(i: int) -> None:
                async with limiter:
                    try:
                        await self.ensure(i, "fill")
                    except pyfuse3.FUSEError:
                        pass
            async with trio.open_nursery() as nursery:
                for i in todo:
                    nursery.start_soon(one, i)
        await self.complete_if_done()


def _file_digest(fd: int) -> str:
    h, off = hashlib.sha256(), 0
    while block := os.pread(fd, 1 << 20, off):
        h.update(block)
        off += len(block)
    return "sha256:" + h.hexdigest()


async def _serve(ops: LazyLayer, prefetch: list[int], fill: bool) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pyfuse3.main)
        say(ready=True)
        nursery.start_soon(ops.background, prefetch, fill)
        nursery.start_soon(ops.trace_later)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                with trio.move_on_after(2):          # a run stopped early still leaves its trace
                    await ops.store_trace()
                nursery.cancel_scope.cancel()
                return


def main() -> None:
    ap = argparse.ArgumentParser(description="Serve one layer file lazily over FUSE (see the module's text).")
    ap.add_argument("--dir", required=True, type=Path)
    ap.add_argument("--manifest", required=True, type=Path)
    ap.add_argument("--nats", required=True)
    ap.add_argument("--creds", default=None)
    ap.add_argument("--prefetch", default="")
    ap.add_argument("--fill", action="store_true")
    args = ap.parse_args()
    raw = args.manifest.read_bytes()
    digest = json.loads(raw)["layer"]
    manifest = chunks.decode_manifest(raw, digest)
    if manifest is None:
        say(error="bad manifest")
        sys.exit(2)
    fetcher = Fetcher(args.nats, args.creds)
    ops = LazyLayer(args.dir, manifest, fetcher)
    options = set(pyfuse3.default_options) | {"fsname=dsec-lazy", "ro"}
    options.discard("default_permissions")
    pyfuse3.init(ops, str(args.dir / "mnt"), options)
    try:
        trio.run(_serve, ops, [int(i) for i in args.prefetch.split(",") if i], args.fill)
    finally:
        pyfuse3.close(unmount=True)


if __name__ == "__main__":
    main()
