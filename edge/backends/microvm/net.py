"""A VM's network (aether/, through the backends' one hook): the sandbox's network end from the node's
Aether, a tap in its namespace bridged to its veth (aether/links.tap), whose fd QEMU's network device uses
(qemu.argv; a VM without a network has the same device on an empty hub). Once the VM runs, the guest is told
its address, route and files by the trusted shell, as root of the guest: the guest's root may change them
later, which gains it nothing, as every packet it sends meets the host's rules on the veth, whatever it
claims to be."""
from __future__ import annotations

import dataclasses
import os
import shlex

from edge.backends.base import BackendError


def guest_setup(end, etc: dict[str, str]) -> str:
    """The trusted shell's script that gives the guest its end's address and route (a fork's guest drops
    its source's first) and writes the files of its /etc (a file in a subdirectory only where the image has
    that directory: apt's config where there is apt). Files are written by the shell's own printf (no
    process: each new one costs a VM under TCG its translation), a symlink in their place removed first."""
    lines = ["set -e", "ip link set eth0 up", "ip addr flush dev eth0",
             f"ip addr add {end.address}/30 dev eth0", f"ip route replace default via {end.gateway}"]
    for name, text in etc.items():
        path = f"/etc/{name}"
        write = f"if [ -L {path} ]; then rm -f {path}; fi; printf '%s' {shlex.quote(text)} > {path}"
        if "/" in name:
            lines.append(f"if [ -d {path.rsplit('/', 1)[0]} ]; then {write}; fi")
        else:
            lines.append(write)
    return "\n".join(lines) + "\n"


class Networking:
    """MicroVMBackend's side of Aether (a mixin: it uses the backend's shell and hook)."""

    async def _attach(self, vm) -> None:
        """Before QEMU starts: the sandbox's end (its policy going into force) and the tap for QEMU; the
        proxy's variables join the VM's environment."""
        end = await self.attach_network(vm.spec)
        if end is None:
            return
        vm.end = end
        try:
            vm.tap = await self.network.tap(vm.spec.id)
        except Exception as exc:
            raise BackendError(f"sandbox {vm.spec.id}: its network: {exc}") from exc
        vm.spec = dataclasses.replace(vm.spec, env={**self.network.sandbox_env(end), **vm.spec.env})

    async def _configure_guest(self, vm) -> None:
        """Once the VM runs: its policy in force, then the guest's address, route and files."""
        if vm.end is None:
            return
        await self.network_in_force(vm.spec)
        code, _, err = await self._shell(vm, guest_setup(vm.end, self.network.sandbox_etc(vm.end)), [], b"")
        if code:
            raise BackendError(f"sandbox {vm.spec.id}: its guest's network setup failed ({code}): "
                               f"{err[-300:].decode(errors='replace')}")

    async def _detach(self, vm) -> None:
        if vm.tap is not None:
            os.close(vm.tap)
            vm.tap = None
        if vm.end is not None:
            vm.end = None
            await self.network.detach(vm.spec.id)
