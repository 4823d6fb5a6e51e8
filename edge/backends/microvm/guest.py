"""What a microVM boots: Debian's cloud kernel (from the Debian package, extracted into a cache, never
installed into the host's /boot), an initramfs (init.sh, a static busybox, the few modules it loads) and
the trusted device (an EROFS image of dsec-agent and the trusted shell, attached read-only).

The kernel is fetched once, by `make setup` (`python -m edge.backends.microvm`), into
$DSEC_VM_CACHE (default /var/cache/dsec/vm), outside any state dir. The initramfs and the trusted
device are rebuilt there whenever their sources change (their names carry a digest of them).
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from edge.backends.native import AGENT_SOURCE, FILES_SOURCE, GUEST_HEADERS, WATCH_SOURCE

KERNEL_PACKAGE = "linux-image-cloud-amd64"   # Debian's metapackage; its dependency is the versioned image
MODULES = ("virtio_ring", "virtio", "virtio_mmio", "virtio_pci_legacy_dev", "virtio_pci_modern_dev", "virtio_pci",
           "virtio_blk", "virtio_console", "libcrc32c", "erofs", "overlay", "virtio-rng", "failover",
           "net_failover", "virtio_net", "libnvdimm", "nd_btt", "nd_pmem", "nd_virtio", "virtio_pmem")
# init.sh loads them in this order, virtio_mmio for a microvm, the virtio_pci ones for a full VM (q35);
# virtio_net (after the two it needs) for a VM's network (aether/: a tap bridged to the sandbox's veth);
# the nvdimm ones for a full VM's OS layer on virtio-pmem (dsec.pmem, read through DAX)
HERE = Path(__file__).parent
INIT = HERE / "init.sh"
TRUSTED_LAYOUT = b"agent files watch sh busybox upper/"   # what the trusted device holds besides the sources (in its name)


class GuestError(Exception):
    """The guest's kernel or images are missing or cannot be built."""


def cache_dir() -> Path:
    return Path(os.environ.get("DSEC_VM_CACHE", "/var/cache/dsec/vm"))


@dataclass(frozen=True)
class Guest:
    """Paths of what a microVM boots."""

    kernel: Path
    initrd: Path
    trusted: Path
    version: str
    stub: Path = Path()     # what a restored VM is given as its kernel (stub_kernel)


def stub_kernel(vmlinuz: bytes) -> bytes:
    """A restored VM's -kernel: the real bzImage's boot header and setup code with 4 KiB of its payload.
    QEMU keeps a -kernel's payload (and the initrd) in its own memory for the firmware to read at boot
    (fw_cfg), ~13.5 MiB of Debian's cloud kernel in every QEMU; a restored VM's RAM comes from its
    template, so it never boots them, and a reset ends it (-no-reboot). The header is the real one, so QEMU
    sets the machine up exactly as for the template (the same option ROMs, RAM blocks and fw_cfg keys)."""
    if vmlinuz[0x202:0x206] != b"HdrS":
        raise GuestError("the guest kernel is not a bzImage (no HdrS header)")
    setup_sects = vmlinuz[0x1f1] or 4
    return vmlinuz[:(setup_sects + 1) * 512 + 4096]


def kernel_dir() -> Path:
    return cache_dir() / "kernel"


def missing() -> str:
    """'' when the guest kernel is in the cache, else why not (a cheap check: no build, no boot)."""
    if not (kernel_dir() / "vmlinuz").is_file():
        return f"no guest kernel in {kernel_dir()} (make setup fetches Debian's {KERNEL_PACKAGE})"
    if _wanted(kernel_dir()) != list(MODULES):
        return f"the guest kernel in {kernel_dir()} lacks modules the guest now loads (make setup extracts them)"
    return ""


def fetch_kernel() -> Path:
    """Download Debian's cloud kernel package and extract vmlinuz and the modules init.sh loads."""
    out = kernel_dir()
    if (out / "vmlinuz").is_file() and _wanted(out) == list(MODULES):
        return out
    dep = subprocess.run(["apt-cache", "depends", KERNEL_PACKAGE], capture_output=True, text=True)
    names = [ln.split(":", 1)[1].strip() for ln in dep.stdout.splitlines() if ln.strip().startswith("Depends:")]
    image = next((n for n in names if n.startswith("linux-image-")), None)
    if image is None:
        raise GuestError(f"apt-cache knows no {KERNEL_PACKAGE} (run apt-get update): {dep.stderr.strip()}")
    cache_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        run = subprocess.run(["apt-get", "download", "-q", image], cwd=tmp, capture_output=True, text=True)
        debs = list(Path(tmp).glob("*.deb"))
        if not debs:
            raise GuestError(f"apt-get download {image} failed: {run.stderr.strip()[-300:]}")
        subprocess.run(["dpkg-deb", "-x", str(debs[0]), f"{tmp}/x"], check=True)
        version = image[len("linux-image-"):]
        stage = Path(tmp) / "kernel"
        (stage / "modules").mkdir(parents=True)
        shutil.copyfile(Path(tmp) / "x" / "boot" / f"vmlinuz-{version}", stage / "vmlinuz")
        found = {p.name[:-3]: p for p in (Path(tmp) / "x" / "lib" / "modules" / version).rglob("*.ko")}
        for mod in MODULES:
            if mod in found:
                shutil.copyfile(found[mod], stage / "modules" / f"{mod}.ko")
        (stage / "version").write_text(version + "\n")
        (stage / "modules.wanted").write_text("\n".join(MODULES) + "\n")
        if out.exists():                 # extracted for fewer modules before
            shutil.rmtree(out)
        os.replace(stage, out)
    return out


def _wanted(kdir: Path) -> list[str]:
    """The modules a cached kernel dir was extracted for (none known for a dir from before they were kept)."""
    try:
        return (kdir / "modules.wanted").read_text().split()
    except FileNotFoundError:
        return ["?"]


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(hashlib.sha256(p).digest())
    return h.hexdigest()[:16]


def _busybox() -> str:
    from edge.erofs import find_busybox
    return find_busybox()


def _newc(entries: list[tuple[str, int, bytes]]) -> bytes:
    """A cpio archive in the kernel's newc format: (name, mode, data) entries, owned by root."""
    out = bytearray()
    for ino, (name, mode, data) in enumerate(entries + [("TRAILER!!!", 0, b"")], start=1):
        nm = name.encode() + b"\0"
        fields = [ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(nm), 0]
        out += b"070701" + b"".join(b"%08X" % f for f in fields) + nm
        out += b"\0" * (-len(out) % 4) + data
        out += b"\0" * (-len(out) % 4)
    return bytes(out)


def build() -> Guest:
    """The guest's kernel, initramfs and trusted device, built where missing or stale."""
    why = missing()
    if why:
        raise GuestError(why)
    kdir = kernel_dir()
    busybox = Path(_busybox()).read_bytes()
    init = INIT.read_bytes()
    mods = {m: (kdir / "modules" / f"{m}.ko").read_bytes() for m in MODULES if (kdir / "modules" / f"{m}.ko").exists()}
    initrd = cache_dir() / f"initrd-{_digest(init, busybox, *mods.values())}.gz"
    if not initrd.exists():
        entries = [(d, 0o40755, b"") for d in ("bin", "dev", "proc", "sys", "lib", "lib/modules", "newroot", "rw",
                                               "trusted", "layers")]
        entries += [("init", 0o100755, init), ("bin/busybox", 0o100755, busybox)]
        entries += [(f"lib/modules/{m}.ko", 0o100644, data) for m, data in mods.items()]
        _put(initrd, gzip.compress(_newc(entries), compresslevel=1))
    source = AGENT_SOURCE.read_bytes()
    helpers = (FILES_SOURCE.read_bytes(), WATCH_SOURCE.read_bytes(), *(h.read_bytes() for h in GUEST_HEADERS))
    from edge.erofs import find_trusted_shell
    shell = Path(find_trusted_shell()).read_bytes()
    trusted = cache_dir() / f"trusted-{_digest(source, *helpers, busybox, shell, TRUSTED_LAYOUT)}.erofs"
    if not trusted.exists():
        with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
            root = Path(tmp) / "root"
            root.mkdir(mode=0o755)
            cc = shutil.which("cc") or shutil.which("gcc") or "cc"
            for name, src in (("agent", AGENT_SOURCE), ("files", FILES_SOURCE), ("watch", WATCH_SOURCE)):
                cc_run = subprocess.run([cc, "-O2", "-static", "-Wall", "-o", str(root / name), str(src)],
                                        capture_output=True, text=True)
                if cc_run.returncode != 0:
                    raise GuestError(f"cannot build the guest's {name}: {cc_run.stderr.strip()[-300:]}")
            (root / "sh").write_bytes(shell)
            shutil.copyfile(_busybox(), root / "busybox")
            for name in ("agent", "files", "watch", "sh", "busybox"):
                os.chmod(root / name, 0o555)
            (root / "upper").mkdir(mode=0o555)     # where init binds the writable layer (read-only) for snapshots
            img = Path(tmp) / "trusted.erofs"
            mk = subprocess.run(["mkfs.erofs", "--quiet", "--all-root", str(img), str(root)],
                                capture_output=True, text=True)
            if mk.returncode != 0:
                raise GuestError(f"mkfs.erofs of the trusted device failed: {mk.stderr.strip()[-300:]}")
            os.chmod(img, 0o444)
            os.replace(img, trusted)
    vmlinuz = (kdir / "vmlinuz").read_bytes()
    stub = cache_dir() / f"stub-{_digest(vmlinuz)}.bzImage"
    if not stub.exists():
        _put(stub, stub_kernel(vmlinuz))
    return Guest(kdir / "vmlinuz", initrd, trusted, (kdir / "version").read_text().strip(), stub)


def _put(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.chmod(tmp, 0o444)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m edge.backends.microvm",
                                 description="Fetch Debian's cloud kernel into the VM cache and build the microVM "
                                             "guest's initramfs and trusted device (make setup runs this).")
    ap.parse_args(argv)
    try:
        fetch_kernel()
        g = build()
    except (GuestError, OSError, subprocess.CalledProcessError) as exc:
        print(f"microvm guest: {exc}", file=sys.stderr)
        return 1
    print(f"microvm guest: kernel {g.version}, {g.initrd.name}, {g.trusted.name} in {cache_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
