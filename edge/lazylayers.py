"""The node's lazily loaded layers (issue 17, part B): a layer the node does not hold but whose chunk manifest
exists is served by a FUSE process of its own (edge/lazyfuse.py) from the moment its manifest is here, so a
sandbox starts before the layer is whole; sandboxes mount that file as a local one. Once every chunk is here
and the whole file matches the layer's digest, the file is linked into the layer cache: later sandboxes mount
it directly, as any fetched layer (those already running keep theirs).

State per layer under <cache>/lazy/<digest>/: data (the chunks fetched so far, sparse), present (a byte a
chunk), manifest.json, mnt/ (the FUSE mount). A restart keeps data and present (the chunks marked are
trusted: each was checked before being marked) and unmounts whatever a dead process left."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from bus import chunks
from bus.conn import Bus
from bus.errors import EnvironmentFailure
from bus.messages import LayerRef
from edge.backends import kernel
from edge.backends.uppers import mount_points

log = logging.getLogger(__name__)

READY_TIMEOUT = 20.0


@dataclass
class Lazy:
    """One layer being served lazily."""

    digest: str
    dir: Path
    proc: asyncio.subprocess.Process | None = None
    ready: asyncio.Future | None = None
    complete: bool = False
    errors: list[str] = field(default_factory=list)
    fetched: dict[str, int] = field(default_factory=dict)   # why -> chunks fetched (read, prefetch, fill)
    counts: dict[int, int] = field(default_factory=dict)    # chunk index -> times fetched (once, always)
    bytes: int = 0
    reader: asyncio.Task | None = None

    @property
    def file(self) -> Path:
        return self.dir / "mnt" / "layer.erofs"


class LazyLayers:
    """FUSE processes of this node's lazily loaded layers, one per layer."""

    def __init__(self, bus: Bus, root: Path, fill: bool = True, on_complete=lambda digest, data: None) -> None:
        self.bus = bus
        self.root = Path(root)
        self.fill = fill
        self.on_complete = on_complete       # (digest, data file): the cache links it in
        self.layers: dict[str, Lazy] = {}
        self.bytes_fetched = 0

    def _dir(self, digest: str) -> Path:
        return self.root / digest.replace(":", "-")

    async def open(self, layer: LayerRef, manifest: chunks.ChunkManifest) -> Path:
        """The path of the layer's file, served lazily (its process started, or already running)."""
        lazy = self.layers.get(layer.digest)
        if lazy is not None and (lazy.proc is None or lazy.proc.returncode is None):
            await asyncio.shield(lazy.ready)
            return lazy.file
        lazy = self.layers[layer.digest] = Lazy(layer.digest, self._dir(layer.digest))
        lazy.ready = asyncio.get_running_loop().create_future()
        try:
            await self._start(lazy, manifest)
            lazy.ready.set_result(True)
        except BaseException as exc:
            lazy.ready.set_exception(exc)
            lazy.ready.exception()
            self.layers.pop(layer.digest, None)
            await self._stop(lazy)
            if isinstance(exc, (OSError, asyncio.TimeoutError, RuntimeError)):
                raise EnvironmentFailure(f"layer {layer.name}@{layer.version} could not be served lazily: {exc}") from exc
            raise
        return lazy.file

    async def _start(self, lazy: Lazy, manifest: chunks.ChunkManifest) -> None:
        (lazy.dir / "mnt").mkdir(parents=True, exist_ok=True)
        self._unmount(lazy.dir / "mnt")
        (lazy.dir / "manifest.json").write_bytes(msgspec.json.encode(manifest))
        prefetch = await chunks.trace(self.bus, lazy.digest)
        args = [sys.executable, "-m", "edge.lazyfuse", "--dir", str(lazy.dir), "--manifest",
                str(lazy.dir / "manifest.json"), "--nats", self.bus.url]
        if self.bus.creds:
            args += ["--creds", self.bus.creds]
        if prefetch:
            args += ["--prefetch", ",".join(map(str, prefetch))]
        if self.fill:
            args.append("--fill")
        lazy.proc = await asyncio.create_subprocess_exec(*args, stdin=asyncio.subprocess.DEVNULL,
                                                         stdout=asyncio.subprocess.PIPE, stderr=None,
                                                         start_new_session=True)
        started = asyncio.get_running_loop().create_future()
        lazy.reader = asyncio.ensure_future(self._read(lazy, started))
        await asyncio.wait_for(asyncio.shield(started), READY_TIMEOUT)

    async def _read(self, lazy: Lazy, started: asyncio.Future) -> None:
        """The process's reports: ready, chunks fetched, errors, complete."""
        assert lazy.proc is not None and lazy.proc.stdout is not None
        async for line in lazy.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if msg.get("ready") and not started.done():
                started.set_result(True)
            elif "fetched" in msg:
                why = msg.get("why", "read")
                lazy.fetched[why] = lazy.fetched.get(why, 0) + 1
                lazy.counts[int(msg["fetched"])] = lazy.counts.get(int(msg["fetched"]), 0) + 1
                lazy.bytes += int(msg.get("bytes", 0))
                self.bytes_fetched += int(msg.get("bytes", 0))
            elif "error" in msg:
                lazy.errors.append(str(msg["error"]))
                log.warning("lazy layer %s: %s", lazy.digest[:19], msg["error"])
            elif msg.get("complete"):
                lazy.complete = True
                with contextlib.suppress(OSError):
                    self.on_complete(lazy.digest, lazy.dir / "data")
        if not started.done():
            started.set_exception(RuntimeError(f"the FUSE process ended ({await lazy.proc.wait()}) before it "
                                               f"served the layer"))

    def stats(self, digest: str) -> Lazy | None:
        return self.layers.get(digest)

    def faults_since(self, digests: list[str], since: float) -> list[str]:
        """The chunk failures (reads that got EIO) of these layers since time.monotonic() `since`: from each
        one's faults file, which its process writes before the failed read returns."""
        out = []
        for d in digests:
            lazy = self.layers.get(d)
            try:
                text = (lazy.dir / "faults").read_text(errors="replace") if lazy is not None else ""
            except OSError:
                continue
            for line in text.splitlines():
                at, _, why = line.partition(" ")
                with contextlib.suppress(ValueError):
                    if float(at) >= since:
                        out.append(f"layer {d[:19]}: {why}")
        return out

    async def _stop(self, lazy: Lazy) -> None:
        if lazy.proc is not None and lazy.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                lazy.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(lazy.proc.wait(), 5)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    lazy.proc.kill()
                await lazy.proc.wait()
        if lazy.reader is not None:
            lazy.reader.cancel()
            await asyncio.gather(lazy.reader, return_exceptions=True)
        self._unmount(lazy.dir / "mnt")

    async def stop(self) -> None:
        await asyncio.gather(*(self._stop(lazy) for lazy in self.layers.values()), return_exceptions=True)
        self.layers.clear()

    def reconcile(self) -> None:
        """At start: unmount what a dead run's processes left (their caches stay)."""
        self.root.mkdir(parents=True, exist_ok=True)
        for point in reversed(mount_points()):
            if point.startswith(f"{self.root}/"):
                self._unmount(Path(point))

    @staticmethod
    def _unmount(point: Path) -> None:
        if str(point) in mount_points():
            try:
                kernel.umount2(str(point))
            except OSError:
                with contextlib.suppress(OSError):
                    kernel.umount2(str(point), kernel.MNT_DETACH)


def link_into(data: Path, path: Path) -> None:
    """A complete lazy layer's file made the cache's (a hard link: no copy; the FUSE process keeps serving
    the same inode to the sandboxes that mounted it through FUSE)."""
    tmp = path.with_suffix(f".{os.getpid()}.lazy")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    os.link(data, tmp)
    os.replace(tmp, path)
