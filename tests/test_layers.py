"""Three layer kinds: a sandbox stacks a base image, a workspace and a toolkit, each its own versioned,
content-addressed EROFS layer; updating one layer rebuilds and uploads only that one."""
from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import stat
import sys
import tarfile
from pathlib import Path

import pytest

import libdsec
from bus import streams

DSEC = os.path.join(os.path.dirname(sys.executable), "dsec")


def dsec(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([DSEC, *args], capture_output=True, text=True, timeout=120)


async def build(url: str, name: str, kind: str, root: Path) -> str:
    p = await asyncio.to_thread(dsec, "image", "build", "--nats", url, name, "--kind", kind, "--from-dir", str(root))
    assert p.returncode == 0, p.stderr
    return p.stdout


async def objects(stack) -> set[str]:
    return {key for key, _ in await stack.bus.kv_items(streams.IMAGES_KV) if "." in key}


async def test_base_workspace_toolkit_compose_and_only_the_updated_layer_changes(stack, client, tmp_path):
    ws, tk = tmp_path / "ws", tmp_path / "tk"
    (ws / "work").mkdir(parents=True)
    (ws / "work" / "README").write_text("repo x\n")
    (tk / "opt" / "tool").mkdir(parents=True)
    (tk / "opt" / "tool" / "version").write_text("1\n")
    (tk / "work").mkdir()
    (tk / "work" / "README").write_text("the toolkit wins over the workspace\n")
    assert (await build(stack.url, "repo-x", "workspace", ws)).startswith("repo-x@1 workspace sha256:")
    assert (await build(stack.url, "tools", "toolkit", tk)).startswith("tools@1 toolkit sha256:")
    assert "unchanged" in await build(stack.url, "tools", "toolkit", tk)    # same bytes: no new version
    old = await client.create(image="busybox", workspace="repo-x", toolkit="tools")
    try:
        r = await old.exec("cat /opt/tool/version /work/README; ls /bin/busybox")
        assert r.stdout == b"1\nthe toolkit wins over the workspace\n/bin/busybox\n", r
        before = await objects(stack)
        (tk / "opt" / "tool" / "version").write_text("2\n")
        assert (await build(stack.url, "tools", "toolkit", tk)).startswith("tools@2 toolkit")
        assert await objects(stack) - before == {"tools.2"}      # one new layer version, nothing else rebuilt
        new = await client.create(image="busybox", workspace="repo-x", toolkit="tools")
        pinned = await client.create(workspace="repo-x@1", toolkit="tools@1")
        try:
            assert (await new.exec("cat /opt/tool/version")).stdout == b"2\n"
            assert (await old.exec("cat /opt/tool/version")).stdout == b"1\n"   # running ones keep theirs
            assert (await pinned.exec("cat /opt/tool/version")).stdout == b"1\n"
            p = await asyncio.to_thread(dsec, "image", "rm", "--nats", stack.url, "tools@2")
            assert p.returncode == 1 and f"in use by sandbox {new.id} (ready); destroy it first" in p.stderr, p.stderr
        finally:
            await new.destroy()
            await pinned.destroy()
        p = await asyncio.to_thread(dsec, "image", "rm", "--nats", stack.url, "tools@2")
        assert p.returncode == 0, p.stderr
        assert (await old.exec("cat /opt/tool/version")).stdout == b"1\n"
    finally:
        await old.destroy()
    ls = (await asyncio.to_thread(dsec, "image", "ls", "--nats", stack.url)).stdout
    assert "repo-x" in ls and "workspace" in ls and "tools" in ls
    latest = await client.create(toolkit="tools")               # tools@2 gone: the latest is 1 again
    try:
        assert (await latest.exec("cat /opt/tool/version")).stdout == b"1\n"
    finally:
        await latest.destroy()


async def test_a_layer_keeps_its_files_mtimes(stack, client, tmp_path):
    """Programs read mtimes (Python trusts a .pyc only while its source has the mtime it recorded; make
    compares them): a layer keeps each file's, to the nanosecond, and the same tree still packs the same."""
    root = tmp_path / "mt"
    (root / "src").mkdir(parents=True)
    (root / "src" / "a.py").write_text("x = 1\n")
    os.utime(root / "src" / "a.py", ns=(1577934245_123456789, 1577934245_123456789))
    os.symlink("a.py", root / "src" / "link")
    os.utime(root / "src" / "link", (1600000000, 1600000000), follow_symlinks=False)
    os.utime(root / "src", (1620259200, 1620259200))
    assert (await build(stack.url, "mtimes", "workspace", root)).startswith("mtimes@1 workspace")
    assert "unchanged" in await build(stack.url, "mtimes", "workspace", root)
    async with await client.create(workspace="mtimes") as sb:
        r = await sb.exec(["stat", "-c", "%y %n", "/src/a.py", "/src", "/src/link"])
        assert r.stdout.decode().splitlines() == ["2020-01-02 03:04:05.123456789 +0000 /src/a.py",
                                                  "2021-05-06 00:00:00.000000000 +0000 /src",
                                                  "2020-09-13 12:26:40.000000000 +0000 /src/link"], r


def test_a_generated_root_packs_to_the_same_digest_each_time(tmp_path):
    """busybox's root is laid out afresh by each node that imports it: twins must publish one digest."""
    from edge.erofs import busybox_rootfs, pack_dir
    digests = set()
    for i in range(2):
        busybox_rootfs(tmp_path / f"r{i}")
        digests.add(pack_dir(tmp_path / f"r{i}", tmp_path / f"l{i}.erofs"))
    assert len(digests) == 1, digests


async def test_layer_kinds_and_names_are_checked(stack, client, tmp_path):
    root = tmp_path / "r"
    root.mkdir()
    (root / "f").write_text("x")
    await build(stack.url, "kindcheck", "workspace", root)
    with pytest.raises(libdsec.InvalidRequest, match="workspace layer, not a toolkit"):
        await client.create(toolkit="kindcheck")
    with pytest.raises(libdsec.InvalidRequest, match="workspace layer, not a base"):
        await client.create(image="kindcheck")
    with pytest.raises(libdsec.ImageNotFound):
        await client.create(workspace="nosuchws")
    p = await asyncio.to_thread(dsec, "image", "build", "--nats", stack.url, "kindcheck", "--kind", "toolkit",
                                "--from-dir", str(root))
    assert p.returncode == 1 and "workspace layer" in p.stderr


async def test_a_layer_from_a_tar(stack, client, tmp_path):
    src = tmp_path / "src"
    (src / "etc").mkdir(parents=True)
    (src / "etc" / "motd").write_text("from a tar\n")
    os.symlink("motd", src / "etc" / "motd-link")
    archive = tmp_path / "layer.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(src, arcname=".")
    p = await asyncio.to_thread(dsec, "image", "build", "--nats", stack.url, "tarws", "--kind", "workspace",
                                "--from-tar", str(archive))
    assert p.returncode == 0, p.stderr
    async with await client.create(workspace="tarws") as sb:
        assert (await sb.exec("cat /etc/motd-link")).stdout == b"from a tar\n"
    evil = tmp_path / "evil.tar"
    with tarfile.open(evil, "w") as tar:
        info = tarfile.TarInfo("../../escape")
        info.size = 0
        tar.addfile(info)
    p = await asyncio.to_thread(dsec, "image", "build", "--nats", stack.url, "evil", "--from-tar", str(evil))
    assert p.returncode == 1 and "Traceback" not in p.stderr


async def test_a_tar_without_its_directories_packs_the_same_again(stack, client, tmp_path):
    """A tar that names neither its root nor a file's parents: those get mtime 0, the named ones theirs, so
    building it again later is the same layer (no new version), and the sandbox sees the tar's times."""
    archive = tmp_path / "bare.tar"
    with tarfile.open(archive, "w") as tar:
        info = tarfile.TarInfo("src/pkg/mod.py")
        info.size, info.mtime = 6, 1_600_000_000
        tar.addfile(info, io.BytesIO(b"x = 1\n"))
        info = tarfile.TarInfo("src/named")
        info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 1_500_000_000
        tar.addfile(info)

    def build() -> subprocess.CompletedProcess:
        return dsec("image", "build", "--nats", stack.url, "baretar", "--kind", "workspace", "--from-tar", str(archive))
    first = await asyncio.to_thread(build)
    assert first.returncode == 0 and first.stdout.startswith("baretar@1 "), first.stderr
    await asyncio.sleep(1.1)
    again = await asyncio.to_thread(build)
    assert again.returncode == 0 and "unchanged" in again.stdout, again.stdout
    async with await client.create(workspace="baretar") as sb:
        r = await sb.exec(["stat", "-c", "%Y %n", "/src/pkg/mod.py", "/src/named", "/src/pkg"])
        assert r.stdout.decode().split("\n")[:3] == ["1600000000 /src/pkg/mod.py", "1500000000 /src/named",
                                                     "0 /src/pkg"], r


async def test_twenty_concurrent_creates_of_a_new_layer_fetch_it_once(stack, client, tmp_path):
    root = tmp_path / "fresh"
    (root / "work").mkdir(parents=True)
    (root / "work" / "blob").write_bytes(os.urandom(1 << 20))    # new bytes: no node holds this layer yet
    await build(stack.url, "fresh-ws", "workspace", root)
    cache = stack.edge.layers
    misses, fetched = cache.misses, cache.bytes_fetched
    boxes = await client.create_many(20, workspace="fresh-ws")
    try:
        assert cache.misses == misses + 1, "one fetch for the 20 first uses"
        assert (1 << 20) < cache.bytes_fetched - fetched < (2 << 20)
        sums = await asyncio.gather(*(sb.exec("md5sum /work/blob | cut -c1-32") for sb in boxes))
        assert len({s.stdout for s in sums}) == 1
    finally:
        await asyncio.gather(*(sb.destroy() for sb in boxes))


async def test_a_cold_node_fetches_only_the_layers_it_needs(stack, client, tmp_path):
    from bus.images import ImageRegistry
    from tests.conftest import extra_edge
    for name, kind, size in (("needed-ws", "workspace", 300 << 10), ("decoy-tk", "toolkit", 2 << 20)):
        root = tmp_path / name
        (root / "data").mkdir(parents=True)
        (root / "data" / "blob").write_bytes(os.urandom(size))
        await build(stack.url, name, kind, root)
    layers = await ImageRegistry(stack.bus).compose("busybox", "needed-ws")
    async with extra_edge(stack, tmp_path / "t5", "t5", 4) as cold:   # empty cache; the best fit
        cache = cold.edge.layers
        assert (cache.misses, cache.bytes_fetched, list(cache.root.glob("*.erofs"))) == (0, 0, [])
        sb = await client.create(workspace="needed-ws")
        try:
            assert sb.node == "t5"
            assert cache.misses == 2 and cache.bytes_fetched == sum(la.size for la in layers)   # base + workspace
            assert sorted(p.name for p in cache.root.glob("*.erofs")) == sorted(
                la.digest.replace(":", "-") + ".erofs" for la in layers)   # not the decoy, nor any other image
        finally:
            await sb.destroy()
    for ref in ("needed-ws@1", "decoy-tk@1"):
        assert (await asyncio.to_thread(dsec, "image", "rm", "--nats", stack.url, ref)).returncode == 0


FAKE_DEBOOTSTRAP = '''#!{python}
"""Stands in for Debian's debootstrap: records its arguments, makes a tiny root."""
import json, os, shutil, sys
args = sys.argv[1:]
with open({calls!r}, "a") as f:
    f.write(json.dumps(args) + "\\n")
root = args[-2]
for d in ("bin", "etc", "var/cache/apt/archives"):
    os.makedirs(os.path.join(root, d), exist_ok=True)
shutil.copy({busybox!r}, os.path.join(root, "bin", "busybox"))
for applet in ("sh", "cat", "ls"):
    os.symlink("busybox", os.path.join(root, "bin", applet))
with open(os.path.join(root, "etc", "os-release"), "w") as f:
    f.write("PRETTY_NAME=made by debootstrap " + " ".join(args) + "\\n")
open(os.path.join(root, "var/cache/apt/archives/python3.deb"), "w").close()
'''


async def test_debootstrap_base_is_made_once_cached_and_slim(stack, client, tmp_path):
    from edge.erofs import find_busybox
    bindir, calls = tmp_path / "bin", tmp_path / "calls"
    bindir.mkdir()
    fake = bindir / "debootstrap"
    fake.write_text(FAKE_DEBOOTSTRAP.format(python=sys.executable, calls=str(calls), busybox=find_busybox()))
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "DSEC_CACHE": str(tmp_path / "cache")}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([DSEC, "image", "build", "--nats", stack.url, *args], capture_output=True, text=True,
                              timeout=120, env=env)
    mirror = "http://127.0.0.1:9/debian"   # never contacted: the stand-in makes the root
    first = await asyncio.to_thread(run, "debbase", "--debootstrap", "bookworm", "--packages", "python3,git,python3",
                                    "--mirror", mirror)
    assert first.returncode == 0 and first.stdout.startswith("debbase@1 base sha256:"), first.stderr
    again = await asyncio.to_thread(run, "debbase", "--debootstrap", "bookworm", "--packages", "git,python3",
                                    "--mirror", mirror)
    assert again.returncode == 0 and "unchanged" in again.stdout and "cached" in again.stderr, again
    made = [json.loads(line) for line in calls.read_text().splitlines()]
    assert len(made) == 1 and made[0][-3:] == ["bookworm", made[0][-2], mirror]
    assert "--variant=minbase" in made[0] and "--include=git,python3" in made[0]
    other = await asyncio.to_thread(run, "debbase", "--debootstrap", "bookworm", "--mirror", mirror)
    assert other.returncode == 0 and other.stdout.startswith("debbase@2 "), other.stderr   # other settings: made anew
    assert len(calls.read_text().splitlines()) == 2
    sb = await client.create(image="debbase@1")
    try:
        r = await sb.exec("cat /etc/os-release; ls /var/cache/apt/archives")
        assert r.stdout.startswith(b"PRETTY_NAME=made by debootstrap --variant=minbase"), r
        assert b".deb" not in r.stdout                       # downloaded packages are not kept in the layer
    finally:
        await sb.destroy()
    bad = await asyncio.to_thread(run, "debbase", "--debootstrap", "bookworm", "--packages", "python3;rm -rf /")
    assert bad.returncode != 0 and "not Debian package names" in bad.stderr
    stray = await asyncio.to_thread(run, "debbase", "--from-dir", str(tmp_path), "--packages", "git")
    assert stray.returncode != 0 and "go with --debootstrap" in stray.stderr
    for ref in ("debbase@1", "debbase@2"):
        assert (await asyncio.to_thread(dsec, "image", "rm", "--nats", stack.url, ref)).returncode == 0


def test_the_debian_mirror_comes_from_apt_sources(tmp_path):
    from edge.debootstrap import apt_mirror
    from bus.errors import InvalidRequest
    (tmp_path / "sources.list.d").mkdir()
    with pytest.raises(InvalidRequest, match="--mirror"):
        apt_mirror(tmp_path)
    (tmp_path / "sources.list").write_text("deb [arch=amd64] http://mirror.example/debian bookworm main\n")
    assert apt_mirror(tmp_path) == "http://mirror.example/debian"
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://other.example/debian-security\nSuites: bookworm-security\n\n"
        "Types: deb\nURIs: http://other.example/debian/\nSuites: bookworm\n")
    assert apt_mirror(tmp_path) == "http://other.example/debian"


def test_a_tar_hard_link_out_of_the_root_is_refused_and_the_host_file_untouched(tmp_path):
    """`dsec image build --from-tar`: tarfile's "tar" filter let a hard link to any host path through, so a
    tarball's member `h` linked to /etc/passwd put the host's file in the layer and then took the member's
    owner, mode and mtime (the host file re-owned); a directory made through a symlink the archive re-points
    out later had its owner, mode and mtime set outside too. Refused, or kept inside, with the host's files as
    they were; a hard link inside the archive still works, modes are kept whole, and a truncated .tgz is a
    clean error too."""
    victim = tmp_path / "victim"
    victim.write_text("secret\n")
    victim.chmod(0o600)
    (tmp_path / "vdir").mkdir(mode=0o700)
    before = victim.stat(), (tmp_path / "vdir").stat()

    def entry(tar, name, kind=tarfile.REGTYPE, linkname=""):
        info = tarfile.TarInfo(name)
        info.type, info.linkname, info.mode, info.uid, info.gid, info.mtime = kind, linkname, 0o755, 4242, 4242, 12345
        tar.addfile(info)
    for name, linkname in (("abs", str(victim)), ("dots", "../victim"), ("via", "up/victim"), ("repoint", "")):
        archive = tmp_path / f"{name}.tar"
        with tarfile.open(archive, "w") as tar:
            if name == "via":   # through a symlink of the archive's own that leaves the root
                entry(tar, "up", tarfile.SYMTYPE, str(tmp_path))
            if name == "repoint":   # a symlink re-pointed out after a directory was made through it
                entry(tar, "real", tarfile.DIRTYPE)
                entry(tar, "a", tarfile.SYMTYPE, "real")
                entry(tar, "a/b", tarfile.DIRTYPE)
                entry(tar, "a", tarfile.SYMTYPE, str(tmp_path / "vdir"))
            else:
                entry(tar, "h", tarfile.LNKTYPE, linkname)
        p = dsec("image", "build", "--nats", "nats://127.0.0.1:1", f"hl{name}", "--kind", "toolkit", "--from-tar", str(archive))
        assert p.returncode == 1, p.stderr
        assert p.stderr.startswith(f"dsec: error: cannot build hl{name}: " if name != "repoint" else
                                   "dsec: error: cannot connect to NATS"), p.stderr   # (that one builds, inside)
        after = victim.stat(), (tmp_path / "vdir").stat()
        assert [(a.st_mode, a.st_uid, a.st_mtime_ns) for a in after] == \
            [(b.st_mode, b.st_uid, b.st_mtime_ns) for b in before] and victim.read_text() == "secret\n", name
        assert os.listdir(tmp_path / "vdir") == [], name
    import cli.main  # noqa: F401  (the CLI's modules import each other in its order)
    from cli.image import unpack_tar
    inside = tmp_path / "inside.tar"
    with tarfile.open(inside, "w") as tar:
        info = tarfile.TarInfo("a/f")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"hi\n"))
        info = tarfile.TarInfo("b")
        info.type, info.linkname = tarfile.LNKTYPE, "a/f"
        tar.addfile(info)
        for name, mode in (("tmp", 0o1777), ("su", 0o4755)):   # modes kept whole (the "tar" filter cut them)
            info = tarfile.TarInfo(name)
            info.type, info.mode = (tarfile.DIRTYPE if name == "tmp" else tarfile.REGTYPE), mode
            tar.addfile(info)
    unpack_tar(inside, tmp_path / "root")
    assert (tmp_path / "root" / "b").read_text() == "hi\n"
    assert os.path.samefile(tmp_path / "root" / "b", tmp_path / "root" / "a" / "f")
    assert [stat.S_IMODE((tmp_path / "root" / n).stat().st_mode) for n in ("tmp", "su")] == [0o1777, 0o4755]
    src = tmp_path / "src"
    src.mkdir()
    (src / "blob").write_bytes(os.urandom(300_000))
    with tarfile.open(tmp_path / "whole.tgz", "w:gz") as tar:
        tar.add(src, arcname=".")
    (tmp_path / "cut.tgz").write_bytes((tmp_path / "whole.tgz").read_bytes()[:100_000])
    p = dsec("image", "build", "--nats", "nats://127.0.0.1:1", "cut", "--from-tar", str(tmp_path / "cut.tgz"))
    assert p.returncode == 1 and p.stderr.startswith("dsec: error: cannot build cut: ") and "internal" not in p.stderr, p.stderr


def test_an_export_onto_a_directory_is_refused_before_any_work(tmp_path):
    """`dsec image export -o DIR`: the export was made first, then failed renaming onto the directory and
    left DIR.part behind. The path is checked first now."""
    (tmp_path / "out").mkdir()
    p = dsec("image", "export", "--nats", "nats://127.0.0.1:1", "--image", "busybox", "-o", str(tmp_path / "out"))
    assert p.returncode == 1 and p.stderr == f"dsec: error: -o: {tmp_path / 'out'} is a directory: name the archive file to write\n", p.stderr
    assert sorted(os.listdir(tmp_path)) == ["out"]
    p = dsec("image", "export", "--nats", "nats://127.0.0.1:1", "--image", "busybox", "-o", "-")
    assert p.returncode == 1 and "not written to standard output" in p.stderr and not os.path.exists("-"), p.stderr
