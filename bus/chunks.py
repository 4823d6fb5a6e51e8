"""Layers in chunks, for lazy loading (issue 17, part B): each published layer also gets a chunk manifest (the
chunk size and the sha256 of every chunk, bound to the layer's digest and size), and its chunks are stored
by their own digest, so a node can fetch the parts a sandbox reads and check each before serving a byte of
it. All of it lives in the layers' object store (no other bucket, no other permission): `chunk-<sha256>`,
`manifest-<layer digest>`, and `trace-<layer digest>` (the chunks a first run of the layer read first, in
order: what the next cold start fetches ahead)."""
from __future__ import annotations

import asyncio
import hashlib
import os
import time
from pathlib import Path

import msgspec

from bus import streams
from bus.conn import Bus
from bus.errors import BusError

CHUNK_SIZE = 1 << 20
TRACE_MAX = 4096        # chunk indices a trace keeps
STORE_AT_ONCE = 8       # chunks being stored at once by a publish


class ChunkManifest(msgspec.Struct, frozen=True):
    """A layer's chunks: chunk i is bytes [i*chunk_size, min(size, (i+1)*chunk_size)) of the layer file."""

    layer: str                       # the layer's digest (sha256:...)
    size: int
    chunk_size: int
    chunks: list[str]                # sha256 hex of each chunk

    def span(self, i: int) -> tuple[int, int]:
        """(offset, length) of chunk i."""
        off = i * self.chunk_size
        return off, min(self.chunk_size, self.size - off)

    def valid(self) -> bool:
        return (self.size >= 0 and self.chunk_size > 0
                and len(self.chunks) == (self.size + self.chunk_size - 1) // self.chunk_size)


_decoder = msgspec.json.Decoder(ChunkManifest)


def manifest_name(digest: str) -> str:
    return f"manifest-{digest.replace(':', '-')}"


def trace_name(digest: str) -> str:
    return f"trace-{digest.replace(':', '-')}"


def chunk_name(sha: str) -> str:
    return f"chunk-{sha}"


def decode_manifest(raw: bytes, digest: str) -> ChunkManifest | None:
    """A manifest of the layer digest names, or None (junk, another layer's, inconsistent)."""
    try:
        m = _decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return m if m.layer == digest and m.valid() else None


def make_manifest(path: Path, digest: str, chunk_size: int = CHUNK_SIZE) -> ChunkManifest:
    size = os.path.getsize(path)
    chunks = []
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk_size), b""):
            chunks.append(hashlib.sha256(block).hexdigest())
    return ChunkManifest(layer=digest, size=size, chunk_size=chunk_size, chunks=chunks)


async def publish(bus: Bus, path: Path, digest: str, chunk_size: int = CHUNK_SIZE) -> ChunkManifest:
    """Store a layer file's chunks (those not stored yet) and its manifest, then any of its chunks gone
    meanwhile (one it found stored may have been an orphan an `image gc` removed: named by the manifest
    now, it is stored again)."""
    manifest = make_manifest(path, digest, chunk_size)
    await _store_missing(bus, path, manifest)
    await bus.obj_put(streams.LAYERS_OBJ, manifest_name(digest), msgspec.json.encode(manifest))
    await _store_missing(bus, path, manifest)
    return manifest


async def _store_missing(bus: Bus, path: Path, manifest: ChunkManifest) -> None:
    """Each chunk not stored yet, STORE_AT_ONCE at a time (one after another, each chunk's round trips were
    most of a layer build's time: 14 s a GiB), each read when it is stored (never the layer in memory)."""
    first: dict[str, int] = {}   # each distinct chunk once (two puts of one name race)
    for i, sha in enumerate(manifest.chunks):
        first.setdefault(sha, i)
    todo = iter(first.items())

    async def worker(fd: int) -> None:
        for sha, i in todo:   # (one iterator shared by the workers: each chunk taken once)
            if await bus.obj_has(streams.LAYERS_OBJ, chunk_name(sha)):
                continue
            off, length = manifest.span(i)
            await bus.obj_put(streams.LAYERS_OBJ, chunk_name(sha), os.pread(fd, length, off))
    fd = os.open(path, os.O_RDONLY)
    workers = [asyncio.ensure_future(worker(fd)) for _ in range(STORE_AT_ONCE)]
    try:
        await asyncio.gather(*workers)
    finally:   # (one failed: the others stop too, before the file is closed)
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        os.close(fd)


async def manifest(bus: Bus, digest: str) -> ChunkManifest | None:
    """The layer's chunk manifest, or None (a layer published before manifests existed: fetched whole)."""
    if not await bus.obj_has(streams.LAYERS_OBJ, manifest_name(digest)):
        return None
    try:
        return decode_manifest(await bus.obj_get(streams.LAYERS_OBJ, manifest_name(digest)), digest)
    except BusError:
        return None


async def trace(bus: Bus, digest: str) -> list[int]:
    """The chunk indices an earlier first run of the layer read first (empty when none is recorded)."""
    try:
        if not await bus.obj_has(streams.LAYERS_OBJ, trace_name(digest)):
            return []
        raw = await bus.obj_get(streams.LAYERS_OBJ, trace_name(digest))
        return [int(i) for i in msgspec.json.decode(raw)][:TRACE_MAX]
    except (BusError, msgspec.DecodeError, ValueError, TypeError):
        return []


async def collect(bus: Bus, min_age: float = 3600.0) -> tuple[int, int]:
    """Remove what no stored layer needs any more (`dsec image gc`): the manifests and traces of layers gone
    (an `image rm` removes the layer only), and chunks no remaining manifest names, stored over min_age
    seconds ago (a publish stores its chunks before its manifest, and checks them again after it: run it when
    no import is under way). (objects removed, bytes of chunks freed, roughly: a chunk each)."""
    objects = await bus.obj_list(streams.LAYERS_OBJ)
    now, live, dropped, freed = time.time(), set(), 0, 0
    for name in [n for n in objects if n.startswith(("manifest-", "trace-"))]:
        digest = name.split("-", 1)[1].replace("-", ":", 1)
        if digest in objects:
            if name.startswith("manifest-"):
                m = decode_manifest(await bus.obj_get(streams.LAYERS_OBJ, name), digest)
                if m is None:
                    return 0, 0   # (a manifest that cannot be read: nothing is removed on a guess)
                live.update(m.chunks)
        elif now - objects[name] > min_age:
            await bus.obj_delete(streams.LAYERS_OBJ, name)
            dropped += 1
    for name in [n for n in objects if n.startswith("chunk-")]:
        if name[len("chunk-"):] not in live and now - objects[name] > min_age:
            await bus.obj_delete(streams.LAYERS_OBJ, name)
            dropped += 1
            freed += CHUNK_SIZE
    return dropped, freed
