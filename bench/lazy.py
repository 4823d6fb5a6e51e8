"""Benchmark: environments at scale (issue 17) — a cold node's first exec of a 1 GiB image, lazy against a
whole fetch, and the import of a 1 GiB OCI archive.

A 1 GiB image of 1,024 files (1 MiB each) is built and published (whole, and in chunks). On a node that holds
none of it, a sandbox is created and runs `md5sum` of two files; timed from the create call to the exec's
end, with the bytes the node fetched. Three ways: the whole layer fetched first (today's path), lazily
(--lazy-layers, no fill behind the reads: what the start itself needed), and lazily again on another cold node
after the first run stored its trace (prefetch). Raw baseline in the same run: `cat` of the layer file on
the host (reading 1 GiB from the page cache).

Then `dsec image import --oci-archive` of a 1 GiB OCI archive (one uncompressed layer of the same files),
beside `tar -x` plus `mkfs.erofs` of the same tree (what an import cannot avoid).

Run: python -m bench.lazy [--files 1024]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import libdsec
from edge import erofs

from tests.ociimages import MIB, files_root as make_root


async def cold_start(tmp: Path, node: str, lazy: bool, url: str, stack_bus) -> tuple[float, int, dict]:
    """Create + first exec on a fresh node (its own state dir): seconds, bytes it fetched, its lazy counts."""
    from cli.stack import Stack
    from edge.capacity import EdgeConfig
    from bus.nodes import set_flag
    st = Stack(tmp / node, nats_url=url, metrics_port=None, run_placement=False,
               edge_config=EdgeConfig(node_id=node, slots=8, aether=False, mirrors=False, lazy_layers=lazy,
                                      lazy_fill=False), creds=None)
    await st.start()
    try:
        async with libdsec.AsyncClient(url) as client:
            t0 = time.perf_counter()
            sb = await client.create(image="benchbig", timeout=120)
            r = await sb.exec("md5sum /data/f0007 /data/f0900")
            took = time.perf_counter() - t0
            assert r.exit_code == 0 and sb.node == node, (r, sb.node)
            await sb.destroy()
        fetched = st.edge.layers.bytes_fetched
        counts = {}
        if lazy:
            from bus.images import ImageRegistry
            layer = (await ImageRegistry(stack_bus).resolve("benchbig"))[0]
            counts = dict(st.edge.layers.lazy.stats(layer.digest).fetched)
        await set_flag(stack_bus, node, draining=True)
        return took, fetched, counts
    finally:
        await st.stop()


async def lazy_runs(files: int) -> None:
    from bus import chunks
    from bus.images import ImageRegistry
    from bus.nodes import set_flag
    from cli.stack import Stack
    from edge.capacity import EdgeConfig
    from bus.server import free_port
    with tempfile.TemporaryDirectory(prefix="dsec-bench-lazy-") as tmpdir:
        tmp = Path(tmpdir)
        make_root(tmp / "root", files)
        # a stack with no edge of its own taking these creates: its node drains once it is up
        st = Stack(tmp / "state", port=free_port(), metrics_port=None, auth=False,
                   edge_config=EdgeConfig(node_id="bench-lazy-main", slots=4, aether=False, mirrors=False))
        await st.start()
        try:
            await set_flag(st.bus, "bench-lazy-main", draining=True)
            dsec = str(Path(sys.executable).parent / "dsec")
            t0 = time.perf_counter()
            await asyncio.to_thread(subprocess.run, [dsec, "image", "build", "--nats", st.url, "benchbig",
                                                     "--from-dir", str(tmp / "root")], check=True, capture_output=True)
            built = time.perf_counter() - t0
            layer = (await ImageRegistry(st.bus).resolve("benchbig"))[0]
            print(f"image: {files} files of 1 MiB, layer {layer.size / MIB:.0f} MiB, built and published (whole and "
                  f"{len((await chunks.manifest(st.bus, layer.digest)).chunks)} chunks) in {built:.1f} s")
            layer_file = tmp / "layer.erofs"
            await st.bus.obj_get_file("dsec-layers", layer.digest, layer_file)
            t0 = time.perf_counter()
            subprocess.run(["cat", str(layer_file)], stdout=subprocess.DEVNULL, check=True)
            raw = time.perf_counter() - t0
            layer_file.unlink()
            rows = []
            for node, lazy in (("bench-whole", False), ("bench-lazy1", True)):
                rows.append((node, lazy, *await cold_start(tmp, node, lazy, st.url, st.bus)))
            for _ in range(50):
                if await chunks.trace(st.bus, layer.digest):
                    break
                await asyncio.sleep(0.2)
            rows.append(("bench-lazy2", True, *await cold_start(tmp, "bench-lazy2", True, st.url, st.bus)))
        finally:
            await st.stop()
    print(f"{'cold node, create + first exec (md5sum of 2 files)':<52} {'seconds':>8} {'fetched MiB':>12} {'of layer':>9}")
    print(f"{'raw: cat of the 1 GiB layer file (page cache)':<52} {raw:>8.2f}")
    names = {"bench-whole": "whole layer fetched first", "bench-lazy1": "lazy (chunks as read)",
             "bench-lazy2": "lazy, second cold node (trace prefetched)"}
    for node, lazy, took, fetched, counts in rows:
        extra = f"  {counts}" if counts else ""
        print(f"{names[node]:<52} {took:>8.2f} {fetched / MIB:>12.1f} {fetched / layer.size:>9.1%}{extra}")
    print("target: lazy <= 1 s and <= 10% read")


def import_run(files: int) -> None:
    with tempfile.TemporaryDirectory(prefix="dsec-bench-import-") as tmpdir:
        tmp = Path(tmpdir)
        make_root(tmp / "root", files)
        layer = tmp / "layer.tar"
        with tarfile.open(layer, "w") as tar:
            tar.add(tmp / "root", arcname=".")
        from tests import ociimages
        ociimages.oci_layout(tmp / "layout", [layer.read_bytes()], config={"Env": ["A=1"]})
        ociimages.archive_of(tmp / "layout", tmp / "image.tar")
        shutil.rmtree(tmp / "layout")
        size = (tmp / "image.tar").stat().st_size
        t0 = time.perf_counter()
        (tmp / "x").mkdir()
        subprocess.run(["tar", "-xf", str(layer), "-C", str(tmp / "x")], check=True)
        subprocess.run(["mkfs.erofs", "--quiet", str(tmp / "x.erofs"), str(tmp / "x")], check=True,
                       env={**os.environ, "SOURCE_DATE_EPOCH": str(erofs.BUILD_TIME)})   # as pack_dir packs
        raw = time.perf_counter() - t0
        from bench.stream import dsec_up
        with dsec_up("--no-aether") as (url, _):
            t0 = time.perf_counter()
            p = subprocess.run([str(Path(sys.executable).parent / "dsec"), "image", "import", "--nats", url,
                                "benchimport", "--oci-archive", str(tmp / "image.tar")], capture_output=True, text=True)
            took = time.perf_counter() - t0
            assert p.returncode == 0, p.stderr
    print(f"{'import of a ' + f'{size / MIB:.0f} MiB OCI archive':<52} {'seconds':>8}")
    print(f"{'raw: tar -x + mkfs.erofs of its layer':<52} {raw:>8.2f}")
    print(f"{'dsec image import --oci-archive (and publish)':<52} {took:>8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=1024, help="1 MiB files in the image (default 1024: 1 GiB)")
    args = ap.parse_args()
    os.environ.setdefault("DSEC_STATE_DIR", tempfile.mkdtemp(prefix="dsec-bench-lazy-sdk-"))
    asyncio.run(lazy_runs(args.files))
    import_run(args.files)


if __name__ == "__main__":
    main()
