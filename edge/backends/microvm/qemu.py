"""QEMU's side of a microVM: its command line, and finding its processes."""
from __future__ import annotations

import os
import stat
from pathlib import Path

from bus import kinds
from edge.backends import kernel
from edge.backends.base import Limits, SandboxSpec
from edge.backends.gvisor.host import processes_where
from edge.backends.microvm.guest import Guest

CMDLINE = "console=ttyS0 quiet panic=-1 reboot=t tsc_early_khz=2000000 tsc=reliable"
SECCOMP = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
# TCG's translation cache: QEMU 7.2 reserves 1 GiB and fills it as the guest runs new code, so a VM running
# much code would pass its cgroup's allowance for QEMU (kinds.OVERHEAD, 96 MiB) and be OOM-killed with its
# guest well within its RAM. Bounded, a full cache is flushed and code translated again (slower, alive).
TB_SIZE_MIB = 48
# A restore is given guest.stub_kernel instead of the kernel and initrd it booted with (0: the real ones, to
# measure what the stub saves: bench.backends)
STUB_RESTORES = os.environ.get("DSEC_VM_STUB_KERNEL", "1") != "0"
MAC = "52:54:00:d5:ec:02"    # the network device's: each VM is alone on its link, one address serves all


# A full VM (q35) boots the root's systemd (init.sh's dsec.os=1) with cgroup v1 hierarchies, as the agent's
# limit groups are (systemd 252 still offers them).
OS_CMDLINE = "dsec.os=1 systemd.unified_cgroup_hierarchy=0 systemd.show_status=0"


def argv(qemu: str, accel: str, g: Guest, spec: SandboxSpec, work: Path, fds: dict[str, int], *, agent: int,
         monitor: int, console: int, ram: int | None, incoming: int | None, machine: str = "microvm",
         load: bool = False, tap: int | None = None, pmem: int = 0) -> list[str]:
    """QEMU's command line: drives are fds (fds: name -> fd; `disk` writable, `disk_ro` its probing twin),
    agent and monitor socket fds, console a file fd. With ram (a memfd): guest RAM in it, shared while a
    template is booted (incoming None), private copy-on-write when restored (incoming: its state's fd);
    load: shared, its content read from the incoming stream by a VM that never runs (-S), which makes a
    memory snapshot's RAM.
    machine: microvm (virtio-mmio devices, the agent as pid 1) or q35 (virtio-pci, the root's systemd).
    Every VM has one network device (templates are restored with or without a network): its backend is tap
    (an fd: the sandbox's network, aether/) or else a hub port with nothing else on its hub (no traffic). The
    tap is made without IFF_VNET_HDR, so it offers no offloads, like the hub port: a guest booted on a hub
    port (a template) restores onto a tap with what it negotiated.
    pmem: the first pmem layers are virtio-pmem devices, not disks: QEMU maps each file read-only and shared
    (every VM's guest reads the host's page cache of it through DAX; a guest's write to it is dropped),
    outside the guest's RAM (slots and maxmem), and out of the saves that keep shared memory out
    (x-ignore-shared: templates, a memory snapshot's state). A memory snapshot's stream carries them (its
    source's RAM is private, so x-ignore-shared is off for it); its loader (load) takes them into shared
    anonymous memory of the same size instead of the file, which its own save then leaves out."""
    limits = spec.limits
    bus = "device" if machine == "microvm" else "pci"
    os_args = "" if machine == "microvm" else f" {OS_CMDLINE}"
    memory: list[str] = []
    if ram is not None:
        machine += ",memory-backend=ram"
        memory = ["-object", f"memory-backend-file,id=ram,size={limits.memory >> 20}M,"
                             f"mem-path=/proc/self/fd/{ram},share={'off' if incoming is not None and not load else 'on'}",
                  *(["-incoming", "defer"] if incoming is not None else []), *(["-S"] if load else [])]
    mapped = [f"layer_{i}" for i in range(pmem)]
    sizes = [os.fstat(fds[name]).st_size for name in mapped]
    pmem_args: list[str] = []
    for name, size in zip(mapped, sizes):
        backend = (f"memory-backend-ram,id={name},size={size},share=on" if load else
                   f"memory-backend-file,id={name},mem-path=/proc/self/fd/{fds[name]},size={size},share=on,readonly=on")
        pmem_args += ["-object", backend, "-device", f"virtio-pmem-pci,memdev={name},id=pmem_{name}"]
    mem = f"{limits.memory >> 20}M" + (f",slots={len(sizes)},maxmem={(limits.memory + sum(sizes)) >> 20}M" if sizes else "")
    host = "template" if ram is not None else spec.id
    accel_opt = accel if accel == "kvm" else f"tcg,tb-size={TB_SIZE_MIB}"
    out = [qemu, "-M", machine, "-accel", accel_opt, *(["-cpu", "host"] if accel == "kvm" else []),
           "-m", mem, *memory, "-smp", str(cpus(limits)), "-nodefaults",
           "-no-user-config", "-no-reboot", "-display", "none", "-sandbox", SECCOMP,
           # a restore's RAM holds its booted kernel: it gets a stub (guest.stub_kernel), and no initrd
           *(["-kernel", str(g.stub)] if incoming is not None and STUB_RESTORES
             else ["-kernel", str(g.kernel), "-initrd", str(g.initrd)]),
           "-append", f"{CMDLINE} dsec.layers={len(spec.layers)} dsec.host={host} dsec.pids={limits.pids}"
                     f"{' dsec.privileged=1' if spec.privileged else ''}{f' dsec.pmem={pmem}' if pmem else ''}{os_args}",
           "-name", str(work),    # what qemu_processes finds it by
           "-chardev", f"file,id=console,path=/dev/fdset/{len(fds) + 1}", "-serial", "chardev:console",
           "-add-fd", f"fd={console},set={len(fds) + 1}",
           "-device", f"virtio-serial-{bus}",
           "-chardev", f"socket,id=agent,fd={agent}", "-device", "virtserialport,chardev=agent,name=dsec.agent",
           "-chardev", f"socket,id=mon,fd={monitor}", "-mon", "chardev=mon,mode=control",
           "-device", f"virtio-rng-{bus}",
           "-netdev", f"tap,id=net0,fd={tap}" if tap is not None else "hubport,id=net0,hubid=0",
           "-device", f"virtio-net-{bus},netdev=net0,mac={MAC}", *pmem_args]
    for n, (name, fd) in enumerate(fds.items(), start=1):
        if name in mapped:
            continue
        ro = name != "disk"
        out += ["-add-fd", f"fd={fd},set={n}"]
        if not ro:   # QEMU opens a writable drive read-only first (probing), then read-write
            out += ["-add-fd", f"fd={fds['disk_ro']},set={n}"]
        elif name == "disk_ro":
            continue
        # no image locks: each drive is this QEMU's own fd, and a VM going on after its memory was saved takes
        # its locks anew, which the fdset's probing twin of its disk refuses ("Failed to get shared 'write' lock")
        out += ["-drive", f"id={name},file=/dev/fdset/{n},format=raw,if=none,file.locking=off"
                          f"{',readonly=on' if ro else ''}",
                "-device", f"virtio-blk-{bus},drive={name},serial=dsec-{name}"]
    return out


DEVICES = ("null", "zero", "full", "random", "urandom")


def confine(uid: int, hide: list[Path], keep: Path, kvm: bool, binary: str) -> None:
    """In QEMU's child before exec (as root): a mount namespace of its own (nothing propagates back) with
    only the mounts QEMU reads (/, /proc, /sys, and those of its binary and of keep: kernel.own_mounts), an
    empty tmpfs over each dir of hide (the node's state and layer cache: its own drives are fds already),
    unless it holds keep (the guest's kernel), and a /dev of its own: null, zero, full, random, urandom,
    and kvm owned by uid when it runs under KVM; then uid's identity, with no groups."""
    read = [os.path.realpath(p) for p in (keep, binary, "/usr/share", "/usr/lib")]
    kernel.own_mounts(["/proc", "/sys", "/dev", *read])
    flags = kernel.MS_NOSUID | kernel.MS_NOEXEC
    for path in hide:
        if path.is_dir() and not keep.is_relative_to(path):
            kernel.mount("tmpfs", path, "tmpfs", flags | kernel.MS_NODEV, "size=4k,mode=0755")
    devices = {name: os.stat(f"/dev/{name}").st_rdev for name in DEVICES + (("kvm",) if kvm else ())}
    kernel.mount("tmpfs", "/dev", "tmpfs", flags, "size=64k,mode=0755")
    for name, rdev in devices.items():
        os.mknod(f"/dev/{name}", stat.S_IFCHR | (0o600 if name == "kvm" else 0o666), rdev)
        os.chmod(f"/dev/{name}", 0o600 if name == "kvm" else 0o666)     # past the umask
    if kvm:
        os.chown("/dev/kvm", uid, uid)
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def qemu_processes(state_dir: Path, sandbox_id: str | None = None) -> list[int]:
    """Pids of QEMUs booted by this node (their console log is under its state dir), or of one VM."""
    vms = Path(state_dir).resolve() / "vms"
    mark = str(vms / sandbox_id).encode() if sandbox_id else f"{vms}/".encode()
    return processes_where(lambda words: any(w == mark if sandbox_id else w.startswith(mark) for w in words))


def cpus(limits: Limits) -> int:
    return max(1, min(os.cpu_count() or 1, int(-(-limits.cpu // 1))))


def disk_size(limits: Limits) -> int:
    return max(limits.disk, kinds.MIN_DISK["microvm"])   # (creates below it are refused: bus/validate.py)


def log_tail(path: Path) -> str:
    """A log's last lines, or the last line there that says why: our guest's init or agent's, or the kernel's
    panic (a panic's dump follows it), but not the panic that only says pid 1 ended ("Attempted to kill
    init"): our init's or agent's last words say why it did."""
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
        why = [ln for ln in lines if "dsec-init:" in ln or "dsec-agent:" in ln
               or ("Kernel panic" in ln and "Attempted to kill init" not in ln)]
        return (why[-1].strip() if why else " | ".join(lines[-3:]))[-400:] or "(empty log)"
    except OSError:
        return "(no log)"
