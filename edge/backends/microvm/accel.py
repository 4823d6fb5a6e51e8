"""Which accelerator a node's VMs run with: KVM where a guest really boots under it, else QEMU's TCG.

A readable /dev/kvm is not enough: a PVM host (this project's CI machines) has one that hangs a stock
guest's boot. So the edge proves it once with a bounded boot of the real guest (`probe`, run by the
backend at start) and remembers the answer per host kernel, QEMU and guest kernel in the VM cache, so a
restart does not pay the probe again. `auto` is the default; `kvm` and `tcg` force a choice (`kvm`
without a usable /dev/kvm is refused at start)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Awaitable, Callable

CHOICES = ("auto", "kvm", "tcg")
PROBE_TIMEOUT = float(os.environ.get("DSEC_KVM_PROBE_TIMEOUT", "10"))


class AccelError(Exception):
    """An accelerator asked for that this host cannot give."""


def kvm_device(path: str = "/dev/kvm") -> bool:
    """Whether the kvm device exists and opens read-write."""
    try:
        os.close(os.open(path, os.O_RDWR | os.O_CLOEXEC))
        return True
    except OSError:
        return False


def choose(requested: str, has_kvm: bool, boots_under_kvm: bool | None) -> str:
    """The accelerator: requested unless auto; auto is kvm only when the device opens and a guest booted
    under it (None: not probed), tcg otherwise."""
    if requested not in CHOICES:
        raise AccelError(f"accel must be one of {', '.join(CHOICES)}, got {requested!r}")
    if requested == "kvm" and not has_kvm:
        raise AccelError("accel kvm asked for, but /dev/kvm is missing or cannot be opened")
    if requested != "auto":
        return requested
    return "kvm" if has_kvm and boots_under_kvm else "tcg"


def host_key(qemu_version: str, guest_version: str, machine: str = "microvm") -> str:
    """What a probe's answer holds for: the host's kernel, QEMU, the guest's kernel and the machine type (a
    q35 full VM boots otherwise than a microvm)."""
    return f"{os.uname().release} {qemu_version} {guest_version} {machine}"


async def resolve(requested: str, cache: Path, key: str, probe: Callable[[], Awaitable[bool]],
                  has_kvm: Callable[[], bool] = kvm_device) -> str:
    """choose(), probing KVM (once per key: the answer is kept in cache) only when it can matter."""
    kvm = has_kvm()
    if requested != "auto" or not kvm:
        return choose(requested, kvm, None)
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict) or not isinstance(known.get(key), bool):
        known = known if isinstance(known, dict) else {}
        known[key] = await probe()
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(known))
            os.replace(tmp, cache)
        except OSError:
            tmp.unlink(missing_ok=True)
    return choose(requested, kvm, known[key])
