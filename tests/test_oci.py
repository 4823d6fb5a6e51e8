"""OCI/Docker import (issue 17, part A): images written here (tests/ociimages.py) imported by `dsec image
import`, checked from inside sandboxes of them: the files, owners, modes, links and what the upper layers
hid; the image's Env, WorkingDir and User on every exec; bad archives refused with one clear line."""
from __future__ import annotations

import asyncio
import gzip
import hashlib
import io
import json
import os
import re
import tarfile
from pathlib import Path

import pytest

import libdsec
from bus import streams
from edge import oci
from edge.backends.treeops import remove_path
from tests import ociimages
from tests.test_layers import dsec


@pytest.fixture(scope="module")
def rich(tmp_path_factory) -> tuple[Path, list[bytes]]:
    tmp = tmp_path_factory.mktemp("oci")
    layers = ociimages.rich_layers(tmp)
    return ociimages.oci_layout(tmp / "layout", layers), layers


async def imported(url: str, name: str, *args: str) -> str:
    p = await asyncio.to_thread(dsec, "image", "import", "--nats", url, name, *args)
    assert p.returncode == 0, p.stderr
    return p.stdout


async def test_a_multi_layer_oci_image_round_trips(stack, client, rich, tmp_path):
    layout, _ = rich
    out = await imported(stack.url, "rich", "--oci-layout", str(layout))
    assert out.startswith("rich@1 base sha256:")
    async with await client.create(image="rich", timeout=60) as sb:
        r = await sb.exec(["/bin/sh", "-c",
                           "cd /data && ls -a . opaque; cat keep.txt; readlink sym; "
                           "stat -c '%n %u %g %a %h %Y' keep.txt hard1 hard2 opaque /bin/suid /work; "
                           "[ $(stat -c %i hard1) = $(stat -c %i hard2) ] && echo same-inode; "
                           "sha256sum big.bin | cut -c1-64"], user="root", cwd="/")
        assert r.exit_code == 0, r
        big = hashlib.sha256(ociimages.big_data()).hexdigest()
        assert r.stdout.decode() == (
            ".:\n.\n..\nbig.bin\nhard1\nhard2\nkeep.txt\nopaque\nsym\nxattr.txt\n\n"   # gone.txt: whited out
            "opaque:\n.\n..\nnew.txt\n"                                                # old.txt: opaque dir
            "keep v2\nkeep.txt\n"
            "keep.txt 1000 2001 640 1 1700000000\nhard1 0 0 600 2 1700000000\nhard2 0 0 600 2 1700000000\n"
            "opaque 0 0 750 2 1700000000\n/bin/suid 0 0 4755 1 1700000000\n/work 1000 1000 755 2 1700000000\n"
            f"same-inode\n{big}\n")
    # xattrs and the file capability are in the layer itself (mounted here, as the node does)
    rec = await stack.bus.kv_get(streams.IMAGES_KV, "rich")
    from bus.records import image_decoder
    digest = image_decoder.decode(rec).digest
    layer = tmp_path / "rich.erofs"
    await stack.bus.obj_get_file(streams.LAYERS_OBJ, digest, layer)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    from edge.backends import kernel
    kernel.mount(str(layer), mnt, "erofs", kernel.MS_RDONLY)
    try:
        assert os.getxattr(mnt / "data/xattr.txt", "user.color") == b"blue"
        assert os.getxattr(mnt / "bin/ping6", "security.capability") == ociimages.CAP_NET_BIND
    finally:
        kernel.umount2(str(mnt))
    # the same image again: content-addressed, no new version
    assert "unchanged" in await imported(stack.url, "rich", "--oci-layout", str(layout))


async def test_the_image_config_is_every_execs_default(stack, client, rich, tmp_path):
    layout, layers = rich
    archive = ociimages.archive_of(layout, tmp_path / "rich.oci.tar")
    await imported(stack.url, "richarc", "--oci-archive", str(archive))
    async with await client.create(image="richarc", timeout=60) as sb:
        r = await sb.exec(["/bin/sh", "-c", "id; pwd; echo $GREETING $HOME $USER; touch mine; stat -c %u:%g mine"])
        assert r.stdout.decode() == ("uid=1000(app) gid=1000(app) groups=1000(app),2001(extra)\n/work\n"
                                     "hello from the image /home/app app\n1000:1000\n"), r
        r = await sb.exec("id -u; pwd; cat /etc/shadow-none 2>&1 >/dev/null; touch /etc/x", user="root", cwd="/tmp")
        assert r.stdout.decode().startswith("0\n/tmp\n") and r.exit_code == 0, r
        r = await sb.exec("touch /etc/y")        # the image's user is no root: its files are not its
        assert r.exit_code != 0 and b"Permission denied" in r.stderr, r
        r = await sb.exec("id -u; id -g", user="65534:2001")
        assert r.stdout == b"65534\n2001\n", r
        for bad, message in (("nosuchuser", "not in the image's /etc/passwd"),
                             ("app:nosuchgroup", "not in the image's /etc/group"), ("99999", "0-65535")):
            with pytest.raises(libdsec.ExecFailed, match=message):
                await sb.exec("true", user=bad)
        assert (await sb.exec("echo still")).stdout == b"still\n"
    # `dsec run --image` without a command runs Entrypoint + Cmd, as the image's user, in its WorkingDir
    p = await asyncio.to_thread(dsec, "run", "--nats", stack.url, "--image", "richarc")
    assert (p.returncode, p.stdout) == (0, "entry hello from the image\n/work\n1000\n"), p.stderr


async def test_a_rollback_to_another_sandboxs_snapshot_is_that_snapshot_as_a_fork_gets_it(stack, client, rich):
    """A rollback took the snapshot's files but kept the sandbox's own defaults: a busybox sandbox rolled back
    to a snapshot of an imported image's sandbox had its files, yet ran as root in / without its env, where a
    fork of the same snapshot runs as its user in its WorkingDir with its env. It now gets what a fork gets
    (the case: a fork going back to the snapshot it came from, a sandbox reset to an episode's start)."""
    layout, _ = rich
    await imported(stack.url, "richroll", "--oci-layout", str(layout))
    show = "id -u; pwd; echo $GREETING; cat /work/state.txt"
    origin = await client.create(image="richroll", timeout=60)
    other = await client.create(env={"MINE": "1"})
    fork = []
    try:
        await origin.exec("echo episode-start > /work/state.txt")
        snap = await origin.snapshot(tag="roll-other")
        fork = await client.fork(snap, env={"WORKER": "3"})
        want = (await fork[0].exec(show)).stdout
        assert want == b"1000\n/work\nhello from the image\nepisode-start\n", want
        await other.rollback(snap)
        assert (await other.exec(show)).stdout == want
        assert (await other.exec("echo $MINE")).stdout == b"1\n"      # its own env over the snapshot's
        rec = await client._record(other.id)
        assert (rec.image, rec.user, rec.cwd) == (snap.image, "app", "/work"), rec
        await fork[0].exec("echo later > /work/state.txt")
        await fork[0].rollback(snap)                  # a fork back to where it came from, with its own env
        assert (await fork[0].exec(show + "; echo $WORKER")).stdout == want + b"3\n"
    finally:
        await asyncio.gather(*(s.destroy() for s in [origin, other, *fork]), return_exceptions=True)
        await client.delete_snapshot("roll-other")


async def test_the_cli_runs_a_command_as_another_user_in_another_dir_with_more_env(stack, client, rich):
    """The image's User, WorkingDir and Env are every exec's defaults; the SDK could override them per exec but
    `dsec exec`/`dsec run` could not (no --user: root was out of reach from the CLI in an image whose User
    is not root)."""
    layout, _ = rich
    await imported(stack.url, "richcli", "--oci-layout", str(layout))
    show = ["sh", "-c", "id -u; pwd; echo $EXTRA $GREETING"]
    async with await client.create(image="richcli", timeout=60) as sb:
        p = await asyncio.to_thread(dsec, "exec", "--nats", stack.url, sb.id, "--", *show)
        assert (p.returncode, p.stdout) == (0, "1000\n/work\nhello from the image\n"), p.stderr
        p = await asyncio.to_thread(dsec, "exec", "--nats", stack.url, "-u", "root", "-w", "/tmp", "-e", "EXTRA=x",
                                    sb.id, "--", *show)
        assert (p.returncode, p.stdout) == (0, "0\n/tmp\nx hello from the image\n"), p.stderr
        p = await asyncio.to_thread(dsec, "exec", "--nats", stack.url, "--user", "nosuchuser", sb.id, "--", "true")
        assert p.returncode == 125 and "not in the image's /etc/passwd" in p.stderr, p.stderr
    p = await asyncio.to_thread(dsec, "run", "--nats", stack.url, "--image", "richcli", "--user", "65534",
                                "--workdir", "/", "--", *show)
    assert (p.returncode, p.stdout) == (0, "65534\n/\nhello from the image\n"), p.stderr


async def test_a_docker_save_archive_imports(stack, client, rich, tmp_path):
    _, layers = rich
    archive = ociimages.docker_archive(tmp_path / "saved.tar", tmp_path, layers,
                                       config={"Env": ["FROM_DOCKER=1"], "WorkingDir": "/data"})
    assert (await imported(stack.url, "saved", "--docker-archive", str(archive))).startswith("saved@1 base")
    async with await client.create(image="saved", timeout=60) as sb:
        r = await sb.exec("echo $FROM_DOCKER; pwd; id -u; cat keep.txt opaque/new.txt")
        assert r.stdout == b"1\n/data\n0\nkeep v2\nnew\n", r


def _bad_layouts(tmp: Path) -> dict[str, tuple[Path, str]]:
    base = ociimages.layer([(ociimages._info("ok.txt"), b"ok\n"), (ociimages._info("etc", tarfile.DIRTYPE, 0o755), None)])
    dev = ociimages.layer([(ociimages._info("dev/evil", tarfile.CHRTYPE, devmajor=1, devminor=1), None)])
    up = ociimages.layer([(ociimages._info("../../escape.txt"), b"out\n")])
    # a symlink planted to the host's /etc, then a file written through it: stays inside the image
    through = ociimages.layer([(ociimages._info("link", tarfile.SYMTYPE, linkname="/etc"), None),
                               (ociimages._info("link/dsec-escape-test"), b"out\n")])
    cases = {}
    for name, layers, message in (("device", [base, dev], "device node"),
                                  ("traversal", [base, up], "path traversal")):
        cases[name] = (ociimages.oci_layout(tmp / name, layers), message)
    big = ociimages.layer([(ociimages._info("big"), os.urandom(500_000))])
    trunc = ociimages.oci_layout(tmp / "truncated", [base, big])
    blob = max((trunc / "blobs/sha256").iterdir(), key=lambda p: p.stat().st_size)
    blob.write_bytes(blob.read_bytes()[:250_000])
    cases["truncated"] = (trunc, "does not match its digest")
    # a docker save whose layer tar is cut short (its manifest names files, not digests)
    saved = ociimages.docker_archive(tmp / "saved-cut.tar", tmp, [base, big])
    with tarfile.open(saved) as tar:
        names = {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}
    cut = max(names, key=lambda n: len(names[n]))
    names[cut] = names[cut][:250_000]
    with tarfile.open(tmp / "saved-cut2.tar", "w") as tar:
        for n, data in names.items():
            ti = tarfile.TarInfo(n)
            ti.size = len(data)
            tar.addfile(ti, io.BytesIO(data))
    cases["docker-truncated"] = (tmp / "saved-cut2.tar", "layer 2")
    cases["through"] = (ociimages.oci_layout(tmp / "through", [base, through]), "")
    return cases


async def test_bad_archives_are_refused_clearly(stack, client, tmp_path):
    for name, (layout, message) in _bad_layouts(tmp_path).items():
        how = "--docker-archive" if name.startswith("docker") else "--oci-layout"
        p = await asyncio.to_thread(dsec, "image", "import", "--nats", stack.url, f"bad-{name}", how, str(layout))
        if not message:     # the planted symlink resolves inside the image's root
            assert p.returncode == 0, p.stderr
            assert not os.path.exists("/etc/dsec-escape-test")
            async with await client.create(image=f"bad-{name}", timeout=60) as sb:
                assert (await sb.read_file("/etc/dsec-escape-test")) == b"out\n"
            continue
        assert p.returncode != 0 and message in p.stderr and "Traceback" not in p.stderr, (name, p.stderr)
        assert len(p.stderr.strip().splitlines()) == 1 or all(line.startswith("layer ") for line in
                                                              p.stderr.strip().splitlines()[:-1]), p.stderr
        assert await stack.bus.kv_get(streams.IMAGES_KV, f"bad-{name}") is None
    assert not os.path.exists("/escape.txt")
    for args, message in ((["--oci-layout", str(tmp_path / "nowhere")], "no such directory"),
                          (["--docker-archive", __file__], "cannot read"),
                          ([], "give exactly one of")):
        p = await asyncio.to_thread(dsec, "image", "import", "--nats", stack.url, "bad-x", *args)
        assert p.returncode != 0 and message in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_whiteouts_apply_to_lower_layers_only(tmp_path):
    """A layer's whiteout hides what is below it, never what the same layer adds (whatever the order)."""
    info = ociimages._info
    low = ociimages.layer([(info("d", tarfile.DIRTYPE, 0o755), None), (info("d/a"), b"low\n")])
    top = ociimages.layer([(info("d/a"), b"top\n"), (info("d/.wh.a"), b""),
                           (info("d/b"), b"b\n"), (info("d/.wh..wh..opq"), b"")])
    layout = ociimages.oci_layout(tmp_path / "l", [low, top])
    oci.apply_layers(oci.read_oci_layout(layout).layers, tmp_path / "root")
    assert sorted(os.listdir(tmp_path / "root/d")) == ["a", "b"]
    assert (tmp_path / "root/d/a").read_bytes() == b"top\n"


def test_zstd_layers_and_digest_mismatches_are_refused(tmp_path):
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        ti = tarfile.TarInfo("f")
        ti.size = 2
        tar.addfile(ti, io.BytesIO(b"hi"))
    layout = ociimages.oci_layout(tmp_path / "l", [gzip.compress(raw.getvalue())],
                                  media="application/vnd.oci.image.layer.v1.tar+zstd")
    with pytest.raises(oci.OciError, match="zstd"):
        oci.read_oci_layout(layout)
    blob = max((layout / "blobs/sha256").iterdir(), key=lambda p: p.stat().st_size)
    blob.write_bytes(blob.read_bytes()[:-1] + b"!")
    with pytest.raises(oci.OciError, match="does not match its digest"):
        oci.read_oci_layout(layout)


async def test_a_snapshot_exports_and_imports_with_the_same_files(stack, client, rich, tmp_path):
    layout, _ = rich
    await imported(stack.url, "richexp", "--oci-layout", str(layout))
    listing = ("cd / && find /data /work /opt -xdev | sort | while read -r f; do "   # (a directory's size and
               "if [ -d \"$f\" ]; then stat -c '%n %u %g %a %F' \"$f\"; "       # link count are its filesystem's)
               "else stat -c '%n %u %g %a %F %s' \"$f\"; fi; done; cat /data/keep.txt; readlink /data/sym; "
               "[ $(stat -c %i /opt/w/one) = $(stat -c %i /opt/w/two) ] && echo linked")
    async with await client.create(image="richexp", timeout=60) as sb:
        r = await sb.exec("mkdir -p /opt/w/sub && echo one > /opt/w/one && ln /opt/w/one /opt/w/two && "
                          "ln -s ../w/one /opt/w/sub/link && chown 1000:2001 /opt/w/one && chmod 4711 /opt/w/one && "
                          "chmod 700 /opt/w/sub && rm /data/hard2 && rm -r /data/opaque && echo v3 > /data/keep.txt",
                          user="root")
        assert r.exit_code == 0, r
        before = await sb.exec(listing, user="root")
        snap = await sb.snapshot(tag="to-export")
    async with await client.create(from_snapshot=snap.id, timeout=60) as fork:   # a fork keeps its defaults
        assert (await fork.exec("pwd; id -u; cat /data/keep.txt")).stdout == b"/work\n1000\nv3\n"
    out = tmp_path / "exported.tar"
    p = await asyncio.to_thread(dsec, "image", "export", "--nats", stack.url, "--snapshot", snap.id, "-o", str(out))
    assert p.returncode == 0 and out.is_file(), p.stderr
    assert (await imported(stack.url, "fromsnap", "--oci-archive", str(out))).startswith("fromsnap@1 base")
    async with await client.create(image="fromsnap", timeout=60) as sb:
        after = await sb.exec(listing, user="root")
        assert after.stdout == before.stdout and after.exit_code == 0, (before.stdout.decode(), after.stdout.decode())
        assert b"/opt/w/one 1000 2001 4711 regular file 4\n" in after.stdout and after.stdout.endswith(b"linked\n")
        assert b"/data/hard2" not in after.stdout and b"/data/opaque" not in after.stdout
        assert (await sb.exec("pwd; echo $GREETING; id -un")).stdout == b"/work\nhello from the image\napp\n"
    # an image exports too, its config with it
    p = await asyncio.to_thread(dsec, "image", "export", "--nats", stack.url, "--image", "richexp",
                                "-o", str(tmp_path / "img.tar"))
    assert p.returncode == 0, p.stderr
    img = oci.read_oci_layout(_unpacked(tmp_path / "img.tar", tmp_path / "img"))
    assert (img.user, img.cwd, img.entrypoint) == ("app", "/work", ["/bin/sh", "-c"])
    p = await asyncio.to_thread(dsec, "image", "export", "--nats", stack.url, "--snapshot", "no-such-snap",
                                "-o", str(tmp_path / "x.tar"))
    assert p.returncode != 0 and "Traceback" not in p.stderr and not (tmp_path / "x.tar").exists(), p.stderr


async def test_a_tree_1200_directories_deep_snapshots_exports_and_imports(stack, client, tmp_path):
    """A sandbox's chain of 1,200 directories: its snapshot sized the upper with os.walk, which recursed
    (RecursionError: the snapshot failed `internal`); export and import walked it the same way. Each now
    keeps the leaf at the bottom."""
    chain = "p=$(printf 'a/%.0s' $(seq 1200)) && mkdir -p $p && echo leaf > $p/f"   # (2,400 bytes: one mkdir)
    count = "find /deep -name f | tr -cd / | wc -c; cat $(find /deep -name f)"
    async with await client.create() as sb:
        assert (await sb.exec(f"mkdir /deep && cd /deep && {chain}", timeout=60)).exit_code == 0
        snap = await sb.snapshot(tag="deep")
    want = b"1202\nleaf\n"
    async with await client.create(from_snapshot=snap.id, timeout=60) as fork:
        assert (await fork.exec(count)).stdout == want
    out = tmp_path / "deep.tar"
    p = await asyncio.to_thread(dsec, "image", "export", "--nats", stack.url, "--snapshot", snap.id, "-o", str(out))
    assert p.returncode == 0, p.stderr
    await imported(stack.url, "deepimg", "--oci-archive", str(out))
    async with await client.create(image="deepimg", timeout=60) as sb:
        assert (await sb.exec(count)).stdout == want
    await client.delete_snapshot(snap)


def _unpacked(archive: Path, into: Path) -> Path:
    oci.unpack_archive(archive, into)
    return into


@pytest.fixture
def registry(tmp_path):
    """Debian's docker-registry on a loopback port of its own, its storage under tmp_path (plain HTTP)."""
    import socket
    import subprocess
    import time
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "registry.yml").write_text(
        f"version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {tmp_path / 'store'}\n"
        f"http:\n  addr: 127.0.0.1:{port}\n")
    proc = subprocess.Popen(["docker-registry", "serve", str(tmp_path / "registry.yml")],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "registry.log", "wb"))
    try:
        for _ in range(100):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


async def test_a_registry_image_is_pulled_by_skopeo(stack, client, rich, registry):
    import subprocess
    layout, _ = rich
    push = subprocess.run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false", f"oci:{layout}:latest",
                           f"docker://{registry}/team/rich:v1"], capture_output=True, text=True, timeout=120)
    assert push.returncode == 0, push.stderr
    out = await imported(stack.url, "pulled", "--from", f"docker://{registry}/team/rich:v1", "--no-tls-verify")
    assert out.startswith("pulled@1 base sha256:")
    async with await client.create(image="pulled", timeout=60) as sb:
        r = await sb.exec("id -un; pwd; cat /data/keep.txt; ls /data/opaque; ls /data/opaque 2>&1", user="root")
        assert r.stdout == b"root\n/work\nkeep v2\nnew.txt\nnew.txt\n", r
        r = await sb.exec("id -un; ls /data/opaque")      # 0750 root's: not the image's user's
        assert r.stdout == b"app\n" and b"Permission denied" in r.stderr, r
    p = await asyncio.to_thread(dsec, "image", "import", "--nats", stack.url, "nosuch", "--from",
                                f"docker://{registry}/team/nosuch:v1", "--no-tls-verify")
    assert p.returncode != 0 and "skopeo copy" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_hostile_layers_are_refused_or_kept_harmless(tmp_path):
    """Helper I's archives: trusted.* xattrs (trusted.overlay.opaque hid the base's /etc under a toolkit),
    a `.wh...` whiteout (it removed the directory above the image's root), a symlink to a directory not
    there yet (refused with EEXIST: Docker makes it), a zstd layer with no media type saying so."""
    info = ociimages._info
    xattrs = ociimages.layer([
        (info("etc", tarfile.DIRTYPE, 0o755, pax_headers={"SCHILY.xattr.trusted.overlay.opaque": "y"}), None),
        (info("etc/f", pax_headers={"SCHILY.xattr.user.k": "v", "SCHILY.xattr.trusted.overlay.redirect": "/bin",
                                    "SCHILY.xattr.security.capability": "\x01\x00\x00\x02" + "\x00" * 16}), b"f")])
    oci.apply_layers([_blob(tmp_path, xattrs)], tmp_path / "x")
    assert os.listxattr(tmp_path / "x/etc") == []
    assert sorted(os.listxattr(tmp_path / "x/etc/f")) == ["security.capability", "user.k"]
    (tmp_path / "w").mkdir()
    (tmp_path / "w/sibling").write_text("kept")
    escape = ociimages.layer([(info("d", tarfile.DIRTYPE, 0o755), None), (info("d/.wh..."), b"")])
    for name in (".wh...", ".wh.."):
        bad = ociimages.layer([(info("d", tarfile.DIRTYPE, 0o755), None), (info(f"d/{name}"), b"")])
        with pytest.raises(oci.OciError, match="names no file"):
            oci.apply_layers([_blob(tmp_path, bad)], tmp_path / "w/root")
    with pytest.raises(oci.OciError):
        oci.apply_layers([_blob(tmp_path, escape)], tmp_path / "w/root")
    assert (tmp_path / "w/sibling").read_text() == "kept" and (tmp_path / "w/root").is_dir()
    dangling = ociimages.layer([(info("var", tarfile.DIRTYPE, 0o755), None),
                                (info("var/run", tarfile.SYMTYPE, linkname="/run"), None),
                                (info("var/run/app.pid"), b"1\n")])
    oci.apply_layers([_blob(tmp_path, dangling)], tmp_path / "s")
    assert (tmp_path / "s/run/app.pid").read_bytes() == b"1\n" and os.readlink(tmp_path / "s/var/run") == "/run"
    for name in ("n" * 255, "d" * 255 + "/f"):   # (mkfs.erofs failed on it: "No such file or directory")
        long = ociimages.layer([(info(name), b"x")])
        with pytest.raises(oci.OciError, match="a name of 255 bytes"):
            oci.apply_layers([_blob(tmp_path, long)], tmp_path / "n")
    fat = ociimages.layer([(info("x", pax_headers={f"SCHILY.xattr.user.{k}": "v" * 2000 for k in "abc"}), b"x")])
    try:   # kept whole where the work dir's filesystem holds them (btrfs, xfs); else refused saying why (ext4, as
        oci.apply_layers([_blob(tmp_path, fat)], tmp_path / "fat")   # here: it was "No space left on device")
        assert os.getxattr(tmp_path / "fat/x", "user.c") == b"v" * 2000
    except oci.OciError as exc:
        assert re.search(r"do not fit .* set TMPDIR", str(exc)), exc
    zstd = tmp_path / "zstd.tar"
    zstd.write_bytes(b"\x28\xb5\x2f\xfd" + b"\x00" * 100)
    with pytest.raises(oci.OciError, match="zstd-compressed"):
        oci.apply_layers([zstd], tmp_path / "z")


def test_a_deep_directory_an_upper_layer_removes_or_replaces_is_removed(tmp_path):
    """A chain of 1,200 directories in one layer, whited out by the next, or replaced by a file: the removal
    recursed in Python and the import died with RecursionError, untyped."""
    info = ociimages._info
    deep = "/".join(["a"] * 1200)
    low = ociimages.layer([(info("/".join(["a"] * i), tarfile.DIRTYPE, 0o755), None) for i in range(1, 1201)]
                          + [(info(deep + "/leaf"), b"x")])
    for top, kept in ((ociimages.layer([(info(".wh.a"), b""), (info("b"), b"b")]), ["b"]),
                      (ociimages.layer([(info("a"), b"file")]), ["a"])):
        root = tmp_path / f"root-{kept[0]}"
        try:
            oci.apply_layers([_blob(tmp_path, low), _blob(tmp_path, top)], root)
            assert sorted(os.listdir(root)) == kept
        finally:   # (a deep tree left in pytest's temp dir would crash a later session's cleanup: it recurses)
            remove_path(root)


def test_a_decompression_bomb_stops_at_the_budget_and_zeros_stay_holes(tmp_path):
    """A small layer that expands past --max-size is refused in a line (a 2 MB gzip made 1 GiB, a 2 kB sparse
    tar 16 GiB, with no limit); zeros are written as holes; a stop (Ctrl-C) ends it between two blocks."""
    info = ociimages._info
    zeros = ociimages.layer([(info("z"), bytes(24 << 20) + b"end")])
    assert len(zeros) < 200_000   # (gzip -1: a ratio of ~230)
    with pytest.raises(oci.OciError, match="add up to more than"):
        oci.apply_layers([_blob(tmp_path, zeros)], tmp_path / "b", budget=oci.Budget(max_bytes=16 << 20))
    oci.apply_layers([_blob(tmp_path, zeros)], tmp_path / "ok")
    st = os.stat(tmp_path / "ok/z")
    assert st.st_size == (24 << 20) + 3 and st.st_blocks * 512 < (2 << 20)   # a sparse file, not 24 MiB of zeros
    stopped = oci.Budget()
    stopped.stop.set()
    with pytest.raises(oci.OciError, match="interrupted"):
        oci.apply_layers([_blob(tmp_path, zeros)], tmp_path / "stopped", budget=stopped)
    with pytest.raises(oci.OciError, match="more than 3 entries"):
        oci.apply_layers([_blob(tmp_path, ociimages.layer([(info(f"f{i}"), b"") for i in range(5)]))],
                         tmp_path / "many", budget=oci.Budget(max_entries=3))


async def test_an_import_cancelled_stops_its_thread_before_it_returns(tmp_path):
    """Ctrl-C: the thread writing the image was left running into a removed directory until the whole
    layer was written (32 s, the disk filling, hidden)."""
    from cli import imports
    info = ociimages._info
    data = os.urandom(1 << 20) * 200   # 200 MiB that is not zeros (uncompressed: quick to make)
    layer = _blob(tmp_path, ociimages.layer([(info("big"), data)], gz=False))
    budget = oci.Budget()
    task = asyncio.ensure_future(imports._stoppable(budget, oci.apply_layers, [layer], tmp_path / "r", print, budget))
    while not (tmp_path / "r/big").exists():
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    size = (tmp_path / "r/big").stat().st_size
    await asyncio.sleep(0.3)
    assert budget.stop.is_set() and (tmp_path / "r/big").stat().st_size == size < len(data)


def test_malformed_image_metadata_is_refused_naming_the_field(tmp_path):
    """A config User of 1000 imported, then made the image invisible and its version number reused; a Cmd
    as a string ran `e`; an index of indexes imported an empty image; shapes crashed as internal errors."""
    from edge import ociread
    lay = ociimages.layer([(ociimages._info("f"), b"x")])
    for config, field_ in (({"User": 1000}, "config User"), ({"Cmd": "echo hi"}, "config Cmd"),
                           ({"Env": {"A": "1"}}, "config Env"), ({"Entrypoint": ["a", 1]}, "config Entrypoint"),
                           ({"WorkingDir": 7}, "config WorkingDir")):
        layout = ociimages.oci_layout(tmp_path / f"l{len(list(tmp_path.iterdir()))}", [lay], config=config)
        with pytest.raises(oci.OciError, match=field_):
            oci.read_oci_layout(layout)
    with pytest.raises(oci.OciError, match="image config"):
        ociread._with_config([], [])
    layout = ociimages.oci_layout(tmp_path / "loop", [lay])
    index = json.loads((layout / "index.json").read_text())
    for _ in range(6):   # indexes inside indexes
        raw = json.dumps({"schemaVersion": 2, "mediaType": ociread.INDEX_TYPES[0], "manifests": [
            dict(index["manifests"][0], platform={"os": "linux", "architecture": "amd64"})]}).encode()
        digest = "sha256:" + hashlib.sha256(raw).hexdigest()
        (layout / "blobs/sha256" / digest[7:]).write_bytes(raw)
        index["manifests"][0] = {"mediaType": ociread.INDEX_TYPES[0], "digest": digest, "size": len(raw)}
    (layout / "index.json").write_text(json.dumps(index))
    with pytest.raises(oci.OciError, match="nested more than"):
        oci.read_oci_layout(layout)
    (layout / "index.json").write_text("[]")
    with pytest.raises(oci.OciError, match="index.json must be a JSON object"):
        oci.read_oci_layout(layout)


async def test_racing_publishers_each_get_a_version_and_junk_is_never_written_over(stack, tmp_path):
    """Two imports of one name at once both printed NAME@1 and one was lost (a read, then a plain put)."""
    from bus.images import ImageRegistry
    from edge.erofs import busybox_rootfs, pack_dir
    made = []
    for i in range(3):
        root = tmp_path / f"r{i}"
        root.mkdir()
        busybox_rootfs(root)
        (root / "which").write_text(str(i))
        made.append((tmp_path / f"{i}.erofs", pack_dir(root, tmp_path / f"{i}.erofs")))
    reg = ImageRegistry(stack.bus)
    (a, _), (b, _) = await asyncio.gather(reg.publish("race-x", *made[0]), reg.publish("race-x", *made[1]))
    assert sorted([a.version, b.version]) == [1, 2]
    listed = [(r.version, r.digest) for r in await reg.list() if r.name == "race-x"]
    assert sorted(listed) == sorted([(a.version, a.digest), (b.version, b.digest)])
    assert (await reg.lookup("race-x")).version == 2
    await stack.bus.kv_put(streams.IMAGES_KV, "race-x.3", b'{"name": "race-x", "version": "junk"}')
    c, new = await reg.publish("race-x", *made[2])
    assert new and c.version == 4 and await stack.bus.kv_get(streams.IMAGES_KV, "race-x.3") == (
        b'{"name": "race-x", "version": "junk"}')
    for v in (1, 2, 4):
        await reg.remove(f"race-x@{v}", {})
    await stack.bus.kv_delete(streams.IMAGES_KV, "race-x.3")
    from bus.errors import InvalidRequest
    from bus.records import ImageConfig
    root = tmp_path / "huge"   # a config too large for its record: refused before its bytes were uploaded
    root.mkdir()
    busybox_rootfs(root)
    (root / "huge").write_text("its own digest")
    digest = pack_dir(root, tmp_path / "huge.erofs")
    with pytest.raises(InvalidRequest, match="more than the bus takes"):
        await reg.publish("huge-x", tmp_path / "huge.erofs", digest, config=ImageConfig(env={"A": "x" * (2 << 20)}))
    assert not await stack.bus.obj_has(streams.LAYERS_OBJ, digest)


async def test_image_gc_frees_the_chunks_of_removed_layers_and_keeps_every_other_layers(stack, tmp_path):
    """`image rm` left a layer's chunks and manifest in the object store for ever (127 MB before an import,
    211 MB after, 171 MB after its rm: helper I)."""
    from bus import chunks
    from bus.images import ImageRegistry
    from edge.erofs import busybox_rootfs, pack_dir
    root = tmp_path / "r"
    root.mkdir()
    busybox_rootfs(root)
    (root / "own.bin").write_bytes(os.urandom(3 << 20))   # chunks of its own, beside the ones busybox shares
    digest = pack_dir(root, tmp_path / "gc.erofs")
    rec, _ = await ImageRegistry(stack.bus).publish("gc-x", tmp_path / "gc.erofs", digest)
    mine = set((await chunks.manifest(stack.bus, digest)).chunks)
    p = await asyncio.to_thread(dsec, "image", "rm", "--nats", stack.url, "gc-x@1")
    assert p.returncode == 0, p.stderr
    before = await stack.bus.obj_list(streams.LAYERS_OBJ)
    assert chunks.manifest_name(digest) in before   # what rm left
    p = await asyncio.to_thread(dsec, "image", "gc", "--nats", stack.url, "--min-age", "0")
    assert p.returncode == 0 and p.stdout.startswith("removed "), p.stderr
    after = await stack.bus.obj_list(streams.LAYERS_OBJ)
    assert chunks.manifest_name(digest) not in after
    kept = set()
    for name in [n for n in after if n.startswith("manifest-")]:   # every other layer keeps all its chunks
        m = await chunks.manifest(stack.bus, name[len("manifest-"):].replace("-", ":", 1))
        assert m is not None and all(chunks.chunk_name(c) in after for c in m.chunks), name
        kept.update(m.chunks)
    assert [c for c in mine - kept if chunks.chunk_name(c) in after] == []


def _blob(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / f"layer-{hashlib.sha256(data).hexdigest()[:12]}"
    path.write_bytes(data)
    return path
