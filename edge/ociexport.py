"""Images out: a snapshot's (or an image's) layers as an OCI archive, so a forked state can leave DSec.

The layers (EROFS files, lowest first) are mounted read-only and overlaid as a sandbox sees them, in a mount
namespace of this process's own (`python -m edge.ociexport`, run by `dsec image export`: its mounts go with
it, whatever ends it), and the merged tree is written as one layer tar (owners, modes, hard links,
symlinks, user.* xattrs and file capabilities), with a config of the snapshot's env and cwd, as an OCI
image layout in a tar."""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import sys
import tarfile
import tempfile
from pathlib import Path

from edge.backends import kernel
from edge.backends.treeops import walk

KEPT_XATTRS = ("user.", "security.capability")


def _tar_tree(root: Path, out) -> None:
    """root's tree as a pax tar (no compression here: the caller gzips), its xattrs in pax headers."""
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for dirpath, dirnames, filenames in walk(root):
            dirnames.sort()
            for name in [*sorted(dirnames), *sorted(filenames)]:
                path = Path(dirpath) / name
                arc = str(path.relative_to(root))
                ti = tar.gettarinfo(str(path), arcname=arc)
                if ti is None:
                    continue                   # a socket: nothing to keep
                ti.uname = ti.gname = ""
                headers = {}
                for attr in os.listxattr(path, follow_symlinks=False):
                    if attr.startswith(KEPT_XATTRS):
                        value = os.getxattr(path, attr, follow_symlinks=False)
                        headers[f"SCHILY.xattr.{attr}"] = value.decode("utf-8", "surrogateescape")
                ti.pax_headers = headers
                if ti.isreg():
                    with open(path, "rb") as f:
                        tar.addfile(ti, f)
                else:
                    tar.addfile(ti)


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def write_archive(root: Path, config: dict, out: Path) -> None:
    """An OCI archive of one gzip layer of root's tree and config (OCI config's `config` object)."""
    with tempfile.TemporaryDirectory(prefix="dsec-export-") as tmp:
        layout = Path(tmp)
        blobs = layout / "blobs" / "sha256"
        blobs.mkdir(parents=True)
        raw = layout / "layer.tar"
        with open(raw, "wb") as f:
            _tar_tree(root, f)
        diff = hashlib.sha256()
        packed = layout / "layer.tar.gz"
        with open(raw, "rb") as src, open(packed, "wb") as dst:
            with gzip.GzipFile(fileobj=dst, mode="wb", compresslevel=1, mtime=0) as gz:
                for block in iter(lambda: src.read(1 << 20), b""):
                    diff.update(block)
                    gz.write(block)
        raw.unlink()
        layer_hash = hashlib.sha256()
        with open(packed, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                layer_hash.update(block)
        layer_digest, layer_size = "sha256:" + layer_hash.hexdigest(), packed.stat().st_size
        os.replace(packed, blobs / layer_hash.hexdigest())

        def put(data: bytes) -> str:
            digest = _digest(data)
            (blobs / digest.split(":")[1]).write_bytes(data)
            return digest
        cfg = json.dumps({"architecture": "amd64", "os": "linux", "config": config,
                          "rootfs": {"type": "layers", "diff_ids": ["sha256:" + diff.hexdigest()]}}).encode()
        manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                               "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                          "digest": put(cfg), "size": len(cfg)},
                               "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                                           "digest": layer_digest, "size": layer_size}]}).encode()
        (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
            {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": put(manifest),
             "size": len(manifest), "annotations": {"org.opencontainers.image.ref.name": "latest"}}]}))
        (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
        tmp_out = out.with_name(out.name + ".part")
        try:
            with tarfile.open(tmp_out, "w") as tar:
                for path in sorted(layout.rglob("*")):
                    tar.add(path, arcname=str(path.relative_to(layout)), recursive=False)
            os.replace(tmp_out, out)
        except BaseException:
            tmp_out.unlink(missing_ok=True)
            raise


def export(layers: list[Path], config: dict, out: Path) -> None:
    """Mount the layers (this process's own mount namespace: call it in a process of its own) and write
    the archive of their merged tree."""
    kernel.unshare(kernel.CLONE_NEWNS)
    kernel.mount(None, "/", None, kernel.MS_REC | kernel.MS_PRIVATE)
    with tempfile.TemporaryDirectory(prefix="dsec-export-mnt-") as tmp:
        mounts: list[Path] = []
        try:
            for i, layer in enumerate(layers):
                point = Path(tmp) / f"l{i}"
                point.mkdir()
                kernel.mount(str(layer), point, "erofs", kernel.MS_RDONLY | kernel.MS_NODEV | kernel.MS_NOSUID)
                mounts.append(point)
            root = mounts[0]
            if len(mounts) > 1:
                root = Path(tmp) / "merged"
                root.mkdir()
                lowers = ":".join(str(p) for p in reversed(mounts))       # top layer first, as overlayfs wants
                kernel.mount("overlay", root, "overlay", kernel.MS_RDONLY | kernel.MS_NODEV | kernel.MS_NOSUID,
                             f"lowerdir={lowers}")
                mounts.append(root)
            write_archive(root, config, out)
        finally:
            for point in reversed(mounts):      # (the namespace goes with this process anyway)
                kernel.umount2(str(point), kernel.MNT_DETACH)


def main() -> None:
    ap = argparse.ArgumentParser(description="Write EROFS layers (lowest first) as an OCI archive.")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--config", default="{}", help="the OCI config's `config` object (JSON)")
    ap.add_argument("layers", nargs="+", type=Path)
    args = ap.parse_args()
    try:
        export(args.layers, json.loads(args.config), args.out)
    except (OSError, ValueError, tarfile.TarError) as exc:
        if os.environ.get("DSEC_DEBUG"):
            import traceback
            traceback.print_exc()
        print(f"export failed: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
