"""OCI and Docker images for the import tests, written here with tarfile and json (no registry, no docker):
layers as tar members (whiteouts, opaque dirs, hard links, symlinks, pax xattrs, a file capability, a
setuid file, a large file, device nodes on demand), then an OCI layout, an OCI archive or a `docker save`
archive of them."""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile
from pathlib import Path

from edge.erofs import busybox_rootfs

# security.capability of cap_net_bind_service+ep (VFS_CAP_REVISION_2: magic, permitted, inheritable)
CAP_NET_BIND = bytes.fromhex("01000002" "00040000" "00000000" "00000000" "00000000")
BIG = 24 << 20


def _info(name: str, kind: bytes = tarfile.REGTYPE, mode: int = 0o644, uid: int = 0, gid: int = 0,
          **extra) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type, ti.mode, ti.uid, ti.gid, ti.mtime = kind, mode, uid, gid, 1_700_000_000
    for k, v in extra.items():
        setattr(ti, k, v)
    return ti


def layer(members: list[tuple[tarfile.TarInfo, bytes | None]], gz: bool = True) -> bytes:
    """A layer tar (gzip by default) of (member, data) pairs, pax format (xattrs go in pax headers)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for ti, data in members:
            if data is not None:
                ti.size = len(data)
            tar.addfile(ti, io.BytesIO(data) if data is not None else None)
    raw = buf.getvalue()
    return gzip.compress(raw, compresslevel=1, mtime=0) if gz else raw


def tree_layer(root: Path) -> bytes:
    """A layer of a directory tree (the busybox base), owners and modes as they are."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.add(root, arcname=".", recursive=True)
    return gzip.compress(buf.getvalue(), compresslevel=1, mtime=0)


def busybox_layer(tmp: Path) -> bytes:
    root = tmp / "bb"
    busybox_rootfs(root)
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:app:/home/app:/bin/sh\n"
                                     "nobody:x:65534:65534:nobody:/:/bin/false\n")
    (root / "etc/group").write_text("root:x:0:\nextra:x:2001:app\napp:x:1000:\nnogroup:x:65534:\n")
    (root / "home/app").mkdir(parents=True, exist_ok=True)
    os.chown(root / "home/app", 1000, 1000)
    return tree_layer(root)


def big_data() -> bytes:
    """BIG bytes that do not compress to nothing (a pattern of sha256 blocks)."""
    out, h = bytearray(), hashlib.sha256(b"dsec")
    while len(out) < BIG:
        h = hashlib.sha256(h.digest())
        out += h.digest() * 64
    return bytes(out[:BIG])


def rich_layers(tmp: Path) -> list[bytes]:
    """The busybox base, then a layer of every kind of entry, then one hiding and replacing some of it."""
    d, f, s, ln = tarfile.DIRTYPE, tarfile.REGTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE
    second = [
        (_info("data", d, 0o755), None),
        (_info("data/keep.txt", f, 0o640, 1000, 2001), b"keep\n"),
        (_info("data/gone.txt"), b"gone\n"),
        (_info("data/opaque", d, 0o755), None),
        (_info("data/opaque/old.txt"), b"old\n"),
        (_info("data/hard1", f, 0o600), b"linked\n"),
        (_info("data/hard2", ln, linkname="data/hard1"), None),
        (_info("data/sym", s, 0o777, linkname="keep.txt"), None),
        (_info("data/xattr.txt", pax_headers={"SCHILY.xattr.user.color": "blue"}), b"x\n"),
        (_info("bin/ping6", f, 0o755, pax_headers={"SCHILY.xattr.security.capability":
                                                   CAP_NET_BIND.decode("utf-8", "surrogateescape")}), b"#!/bin/sh\n"),
        (_info("bin/suid", f, 0o4755), b"#!/bin/sh\nid\n"),
        (_info("data/big.bin"), big_data()),
        (_info("work", d, 0o755, 1000, 1000), None),
    ]
    third = [
        (_info("data/.wh.gone.txt"), b""),
        (_info("data/opaque", d, 0o750), None),
        (_info("data/opaque/.wh..wh..opq"), b""),
        (_info("data/opaque/new.txt"), b"new\n"),
        (_info("data/keep.txt", f, 0o640, 1000, 2001), b"keep v2\n"),
    ]
    return [busybox_layer(tmp), layer(second), layer(third, gz=False)]


CONFIG = {"Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "GREETING=hello from the image"], "WorkingDir": "/work",
          "User": "app", "Entrypoint": ["/bin/sh", "-c"], "Cmd": ["echo entry $GREETING; pwd; id -u"]}


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _config_blob(layers: list[bytes], config: dict) -> bytes:
    diff_ids = [_digest(gzip.decompress(b) if b[:2] == b"\x1f\x8b" else b) for b in layers]
    return json.dumps({"architecture": "amd64", "os": "linux", "config": config,
                       "rootfs": {"type": "layers", "diff_ids": diff_ids}}).encode()


def oci_layout(out: Path, layers: list[bytes], config: dict = CONFIG, ref: str = "latest",
               media: str = "") -> Path:
    """Write an OCI image layout of layers at out (media: every layer's media type, else tar or tar+gzip)."""
    blobs = out / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(data: bytes) -> str:
        digest = _digest(data)
        (blobs / digest.split(":")[1]).write_bytes(data)
        return digest
    cfg = _config_blob(layers, config)
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": put(cfg),
                           "size": len(cfg)},
                "layers": [{"mediaType": media or "application/vnd.oci.image.layer.v1.tar" + (
                                "+gzip" if b[:2] == b"\x1f\x8b" else ""),
                            "digest": put(b), "size": len(b)} for b in layers]}
    raw = json.dumps(manifest).encode()
    (out / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": manifest["mediaType"], "digest": put(raw), "size": len(raw),
         "annotations": {"org.opencontainers.image.ref.name": ref}}]}))
    (out / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return out


def archive_of(src: Path, out: Path) -> Path:
    """A plain tar of a directory's files (an OCI archive of a layout; a docker save of its files)."""
    with tarfile.open(out, "w") as tar:
        for path in sorted(src.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(src)), recursive=False)
    return out


def docker_archive(out: Path, tmp: Path, layers: list[bytes], config: dict = CONFIG) -> Path:
    """A `docker save` archive (the classic layout: <id>/layer.tar uncompressed, <id>.json config)."""
    root = tmp / "docker"
    root.mkdir()
    names = []
    for b in layers:
        raw = gzip.decompress(b) if b[:2] == b"\x1f\x8b" else b
        lid = hashlib.sha256(raw).hexdigest()
        (root / lid).mkdir()
        (root / lid / "layer.tar").write_bytes(raw)
        names.append(f"{lid}/layer.tar")
    cfg = _config_blob(layers, config)
    cid = hashlib.sha256(cfg).hexdigest()
    (root / f"{cid}.json").write_bytes(cfg)
    (root / "manifest.json").write_text(json.dumps([{"Config": f"{cid}.json", "RepoTags": ["test:latest"],
                                                      "Layers": names}]))
    return archive_of(root, out)


MIB = 1 << 20


def mib_of(i: int, salt: bytes = b"lazy") -> bytes:
    """File i's MiB of a many-file image: different in every file (no chunk is shared by two)."""
    head = hashlib.sha256(salt + b"%d" % i).digest()
    return (head * (MIB // len(head)))[:MIB]


def files_root(root: Path, files: int, salt: bytes = b"lazy") -> Path:
    """A busybox root with /data/f0000.. of 1 MiB each (the lazy-loading tests' and bench.lazy's image)."""
    busybox_rootfs(root)
    (root / "data").mkdir()
    for i in range(files):
        (root / "data" / f"f{i:04d}").write_bytes(mib_of(i, salt))
    return root
