"""Full VMs: QEMU `-M q35` booting a whole Debian (systemd as pid 1) for work that needs an operating
system, behind the same calls as every other kind.

A full VM is a microVM's machinery (microvm/: QEMU confined as the sandbox's uid in its own groups and
mount namespace, drives as fds, templates, snapshots, the same dsec-agent on the same read-only trusted
device) with three differences:
- the machine is q35 (PCI: virtio-pci devices, ACPI, a BIOS that loads the kernel);
- its root is the node's OS layer (osimage.py: Debian bookworm with systemd, built at setup) under the
  image's layers and the VM's writable disk, so any image boots as a whole Debian with its files on top;
- the agent (pid 1 of its own pid namespace, as in a microVM) first starts the root's systemd as pid 1 of a
  child pid and mount namespace, where every command runs too: /proc/1 is systemd, and the agent has no pid
  there (dsec-agent.c, start_os). systemd's end (poweroff) ends the agent, hence the VM: the sandbox ends
  failed, as when a microVM's agent ends.
Commands are confined by the agent as in a microVM (own mount namespace, the limit groups and
/sys/fs/cgroup hidden, the /proc masks, SYS_ADMIN, SYS_MODULE, SYS_RAWIO, SYS_PTRACE, SYS_BOOT and SYS_RESOURCE
dropped). systemd is the guest's own root and starts any unit a root command writes, so the boundary a full
VM promises is the VM: the host and the other sandboxes (docs/backends.md). Not privileged, systemd's own
bounding set lacks SYS_MODULE and SYS_RAWIO, so no unit loads a module into the guest's kernel either.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path

from bus import kinds
from edge.backends.base import BackendError, SandboxSpec
from edge.backends.fullvm import osimage
from edge.backends.microvm import VM, MicroVMBackend

__all__ = ["FullVMBackend", "leftovers"]

DAX = os.environ.get("DSEC_VM_DAX", "1") != "0"
SETTLE_TIMEOUT = 120.0     # seconds a template's systemd may take to finish booting under TCG


class FullVMBackend(MicroVMBackend):
    """One QEMU q35 per sandbox, a whole Debian whose systemd runs the agent."""

    kind = kinds.FULLVM
    machine = "q35"

    async def start(self) -> None:
        why = osimage.missing()
        if why:
            raise BackendError(f"fullvm backend failed to start: {why}")
        await super().start()

    async def create(self, spec: SandboxSpec) -> None:
        await super().create(dataclasses.replace(spec, layers=[str(osimage.path()), *spec.layers]))

    def _probe_layers(self) -> list[str]:
        return [str(osimage.path())]

    def _pmem(self, spec: SandboxSpec) -> int:
        """The OS layer (every full VM's lowest) is a virtio-pmem device read through DAX, so its pages are the
        host's page cache of the file, shared by every full VM on the node, not copies in each guest's RAM;
        unless it was built before it could be (osimage.dax_ready) or DSEC_VM_DAX=0 (measuring it off).
        A fork of a memory snapshot names its layers by the fds the snapshot holds (/proc/self/fd/N), and
        must get the devices its snapshot was taken with: it is judged by the file it holds."""
        return 1 if DAX and spec.layers and osimage.dax_ready(spec.layers[0]) else 0

    async def _settle(self, vm: VM) -> None:
        """A template is saved once systemd finished booting (its restores start `running`, not starting).
        systemd answers `offline` until it mounted /run (the agent answers first), then `initializing` and
        `starting` until its boot's jobs ended. Each ask is an exec of its own: an exec sees the mounts of
        its start (its mount namespace is a copy), and `--wait` would need D-Bus, which the OS has not."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SETTLE_TIMEOUT
        while True:      # each ask bounded too: the deadline holds even when one hangs
            left = max(1.0, min(10.0, deadline - loop.time()))
            code, out, err = await self._shell(vm, "systemctl is-system-running", [], b"", left)
            state = out.decode(errors="replace").strip()
            if state in ("running", "degraded"):
                return
            if loop.time() > deadline:    # (early on, it may not even answer: its socket is not there yet)
                raise BackendError(f"the template's systemd did not finish booting: {state or 'no answer'} "
                                   f"(exit {code}) {err.decode(errors='replace').strip()[-200:]}")
            await asyncio.sleep(0.1)


def leftovers(state_dir: Path, node_id: str) -> list[str]:
    """Everything a fullvm node (its state in state_dir) left on the host, without starting one."""
    return FullVMBackend(state_dir, node_id).leftovers()
