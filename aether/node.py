"""Aether on one node, the edge's side: the node's links (links.py), rules (rules.py) and proxy process
(serve.py), and the one hook every backend's network goes through:

    end = await aether.attach(sandbox_id, policy)    # a namespace (container) with its policy in force
    await aether.set_policy(sandbox_id, policy)      # in force for every connection opened after it returns
    await aether.detach(sandbox_id)

Namespaces are made ahead (POOL of them, off the create path). The proxy is supervised: if it dies it is
started again on the same ports and told every sandbox's policy before it serves. Decisions it reports
go to `on_report(sandbox_id, report)` (the edge puts them on the sandbox's trajectory).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ipaddress
import itertools
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import msgspec
from pyroute2.netlink.exceptions import NetlinkError

from aether import mirrors as mirrors_mod, rules
from aether.links import End, LinkError, Links, shape, tap
from bus.network import DEFAULT_BANDWIDTH, Network
from bus.server import die_with_parent
from edge.backends.execio import exited

log = logging.getLogger(__name__)

POOL = 16                    # namespaces kept made ahead
LOW_WATER = 4                # below it the pool is refilled at once, creates or not
QUIET = 0.05                 # seconds without an attach before the pool is refilled above LOW_WATER
ANSWER_TIMEOUT = 5.0         # seconds the proxy has to answer an op
START_TIMEOUT = 10.0
RESTART_DELAY = 0.2
LINGER = 10.0                # seconds a freed end's link may outlive it (the kernel's batched teardown)


class AetherError(Exception):
    """The node's network could not be set up, or an op did not take effect."""


def default_resolver() -> str:
    """The host's first nameserver (what --aether-dns defaults to), or '' when it has none."""
    try:
        for line in Path("/etc/resolv.conf").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "nameserver":
                ipaddress.IPv4Address(parts[1])
                return parts[1]
    except (OSError, ValueError):
        pass
    return ""


class Aether:
    """The node's sandbox networking."""

    def __init__(self, node: str, dns: str = "", allow_cidrs: list[str] | tuple = (),
                 on_report: Callable[[str, dict], None] | None = None, pool: int = POOL,
                 mirrors: dict[int, int] | None = None) -> None:
        self.mirrors = mirrors or {}           # gateway port -> the local port of the node's mirror behind it
        self._unshaped = tuple(sorted(self.mirrors))   # the mirrors' gateway ports: not capped
        self.node, self.dns, self.allow_cidrs = node, dns or default_resolver(), list(allow_cidrs)
        self.on_report = on_report or (lambda _sid, _r: None)
        self.pool_size = pool
        self.links: Links | None = None
        self.port = self.dns_port = 0
        self.attached: dict[str, tuple[End, Network]] = {}
        self.tenants: dict[str, str] = {}   # sandbox -> its tenant (the proxy's connections are shared by tenant)
        self._applying: dict[str, asyncio.Task] = {}      # attach's policy, being put in force
        self._last_attach = 0.0
        self._pool: list[End] = []
        self._proc: subprocess.Popen | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._answers: dict[int, asyncio.Future] = {}
        self._seq = itertools.count(1)
        self._tasks: list[asyncio.Task] = []
        self._ready = asyncio.Event()
        self._stopping = False
        # One thread makes and frees namespaces (setns moves a thread: never the event loop's).
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aether-links")
        self._fill_wanted = asyncio.Event()

    async def _in_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def _make(self) -> End:
        """A new network end; one a cancelled caller no longer wants is freed, never left behind."""
        fut = asyncio.get_running_loop().run_in_executor(self._thread, self.links.make)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await self._in_thread(self.links.free, await fut)
            raise

    # ---- lifecycle ---------------------------------------------------------------------------------------

    async def start(self) -> None:
        try:
            self.links = await self._in_thread(Links, self.node)
            await self._spawn()
            await self._in_thread(rules.install, self.node, self.port, self.dns_port)
        except BaseException:
            await self.stop()
            raise
        self._tasks += [asyncio.ensure_future(self._supervise()), asyncio.ensure_future(self._fill())]
        self._fill_wanted.set()

    async def stop(self) -> None:
        self._stopping = True
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._kill()
        ends = self._pool + [end for end, _ in self.attached.values()]
        self._pool, self.attached, self.tenants = [], {}, {}
        if self.links is not None:
            for end in ends:
                await self._in_thread(self.links.free, end)
            for _ in range(int(LINGER / 0.05)):        # the node's links gone before it says it stopped
                if not await self._in_thread(self.links.leftovers):
                    break
                await asyncio.sleep(0.05)
        with contextlib.suppress(Exception):
            await self._in_thread(rules.remove, self.node)
        if self.links is not None:
            with contextlib.suppress(Exception):
                await self._in_thread(self.links.close)
        self._thread.shutdown(wait=False)

    async def _spawn(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        repo = str(Path(__file__).resolve().parent.parent)
        argv = [sys.executable, "-m", "aether.serve", "--control-fd", str(theirs.fileno()),
                "--port", str(self.port), "--dns-port", str(self.dns_port), "--node", self.node,
                "--sandboxes", str(self.links.subnet)]
        if self.dns:
            argv += ["--dns", self.dns]
        for cidr in self.allow_cidrs:
            argv += ["--allow-cidr", cidr]
        for port, local in self.mirrors.items():
            argv += ["--mirror", f"{port}=127.0.0.1:{local}"]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": repo}
        self._proc = subprocess.Popen(argv, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, env=env, cwd=repo, start_new_session=True,
                                      preexec_fn=die_with_parent)   # a SIGKILLed edge leaves no proxy
        theirs.close()
        reader, self._writer = await asyncio.open_unix_connection(sock=ours, limit=1 << 22)
        try:
            hello = msgspec.json.decode(await asyncio.wait_for(reader.readline(), START_TIMEOUT))["hello"]
        except (asyncio.TimeoutError, msgspec.DecodeError, KeyError, TypeError) as exc:
            raise AetherError(f"the Aether proxy of node {self.node} did not start ({exc or 'timeout'})") from None
        self.port, self.dns_port = hello["port"], hello["dns_port"]
        self._tasks.append(asyncio.ensure_future(self._read(reader)))
        for sid, (end, policy) in self.attached.items():   # a restart: every policy before it serves
            await self._op({"op": "set", "address": end.address, "sandbox": sid, "tenant": self.tenants.get(sid, ""),
                            "policy": msgspec.to_builtins(policy)}, ready=False)
        self._ready.set()

    async def _kill(self) -> None:
        self._ready.clear()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            await exited(self._proc)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        while line := await reader.readline():
            try:
                msg = msgspec.json.decode(line)
            except msgspec.DecodeError:
                continue
            if "report" in msg:
                for item in msg["report"]:
                    try:
                        self.on_report(item["sandbox"], item)
                    except Exception:   # a report is never worth the reader
                        log.exception("network report of %s", item.get("sandbox"))
            elif (fut := self._answers.pop(msg.get("seq", 0), None)) is not None and not fut.done():
                fut.set_result(msg.get("error"))
        for fut in self._answers.values():
            if not fut.done():
                fut.set_exception(AetherError("the Aether proxy went away"))
        self._answers.clear()

    async def _supervise(self) -> None:
        while True:
            await exited(self._proc)
            if self._stopping:
                return
            log.warning("the Aether proxy of node %s died (%s): starting it again", self.node, self._proc.returncode)
            await self._kill()
            await asyncio.sleep(RESTART_DELAY)
            try:
                await self._spawn()
            except (AetherError, OSError) as exc:
                log.error("the Aether proxy of node %s did not start again: %s", self.node, exc)

    async def _fill(self) -> None:
        while True:
            await self._fill_wanted.wait()
            self._fill_wanted.clear()
            while len(self._pool) < self.pool_size:
                # Making one holds the interpreter for most of its ~25 ms: while creates come, and the pool
                # is not low, it waits for a quiet moment rather than slow them down.
                while len(self._pool) > LOW_WATER and time.monotonic() - self._last_attach < QUIET:
                    await asyncio.sleep(QUIET)
                try:
                    end = await self._make()
                except (LinkError, OSError) as exc:
                    log.warning("making a sandbox network ahead: %s", exc)
                    break
                self._pool.append(end)   # held from now (an attach shapes it if it takes it first)
                self.links.held(end)
                try:
                    await self._in_thread(shape, end, DEFAULT_BANDWIDTH, self._unshaped)
                    end.bandwidth = DEFAULT_BANDWIDTH
                except Exception as exc:
                    log.warning("shaping a sandbox network: %s", exc)

    # ---- the hook ----------------------------------------------------------------------------------------

    async def _op(self, msg: dict, ready: bool = True) -> None:
        if ready:
            await asyncio.wait_for(self._ready.wait(), ANSWER_TIMEOUT)
        if self._writer is None:
            raise AetherError("the Aether proxy is not running")
        seq = next(self._seq)
        fut = asyncio.get_running_loop().create_future()
        self._answers[seq] = fut
        self._writer.write(msgspec.json.encode({**msg, "seq": seq}) + b"\n")
        try:
            await self._writer.drain()
            error = await asyncio.wait_for(fut, ANSWER_TIMEOUT)
        except (asyncio.TimeoutError, ConnectionError) as exc:
            raise AetherError(f"the Aether proxy did not take the change ({exc or 'timeout'})") from None
        finally:
            self._answers.pop(seq, None)
        if error:
            raise AetherError(error)

    async def attach(self, sandbox_id: str, policy: Network, tenant: str = "") -> End:
        """A network end for a sandbox of `tenant` (the pool's, else a new one). Its policy is being put in
        force meanwhile: the backend awaits in_force() before the sandbox runs anything of its own."""
        if sandbox_id in self.attached:
            raise AetherError(f"sandbox {sandbox_id} has a network already")
        end = self._pool.pop() if self._pool else None
        self._last_attach = time.monotonic()
        self._fill_wanted.set()
        if end is None:
            end = await self._make()
        self.attached[sandbox_id] = (end, policy)
        self.tenants[sandbox_id] = tenant
        self.links.held(end)
        self._applying[sandbox_id] = asyncio.ensure_future(self._apply(sandbox_id, end, policy))
        return end

    async def tap(self, sandbox_id: str) -> int:
        """A VM's way onto its sandbox's end (links.tap): the tap's fd, for its QEMU."""
        item = self.attached.get(sandbox_id)
        if item is None:
            raise AetherError(f"sandbox {sandbox_id} has no network")
        try:
            return await self._in_thread(tap, item[0])
        except (OSError, NetlinkError) as exc:
            raise AetherError(f"sandbox {sandbox_id}: its VM's tap: {exc}") from exc

    async def in_force(self, sandbox_id: str) -> None:
        """Once the policy attach() began to apply is in force (AetherError if it could not be)."""
        task = self._applying.pop(sandbox_id, None)
        if task is not None:
            await task

    async def _apply(self, sandbox_id: str, end: End, policy: Network) -> None:
        rate = policy.bandwidth or DEFAULT_BANDWIDTH
        if end.bandwidth != rate:
            await self._in_thread(shape, end, rate, self._unshaped)
            end.bandwidth = rate
        await self._op({"op": "set", "address": end.address, "sandbox": sandbox_id,
                        "tenant": self.tenants.get(sandbox_id, ""), "policy": msgspec.to_builtins(policy)})

    async def set_policy(self, sandbox_id: str, policy: Network) -> None:
        """Change a sandbox's policy; in force for every connection it opens once this returns."""
        end, _ = self.attached[sandbox_id]
        await self._apply(sandbox_id, end, policy)
        self.attached[sandbox_id] = (end, policy)

    async def detach(self, sandbox_id: str) -> None:
        """The sandbox's policy dropped and its network end freed (its namespace goes with its last fd)."""
        task = self._applying.pop(sandbox_id, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        item = self.attached.pop(sandbox_id, None)
        self.tenants.pop(sandbox_id, None)
        if item is None:
            return
        with contextlib.suppress(AetherError, asyncio.TimeoutError):
            await self._op({"op": "drop", "address": item[0].address}, ready=False)
        await self._in_thread(self.links.free, item[0])

    def sandbox_env(self, end: End) -> dict[str, str]:
        """Environment of a sandbox on this end: HTTP(S)_PROXY and friends (the proxy on its gateway; every
        TCP connection reaches the proxy anyway)."""
        url = f"http://{end.gateway}:{self.port}"
        env = {"HTTP_PROXY": url, "HTTPS_PROXY": url, "http_proxy": url, "https_proxy": url,
               "NO_PROXY": f"localhost,127.0.0.1,{end.gateway}", "no_proxy": f"localhost,127.0.0.1,{end.gateway}"}
        env.update(mirrors_mod.sandbox_env(end.gateway, set(self.mirrors)))
        return env

    def sandbox_etc(self, end: End) -> dict[str, str]:
        """Files of a sandbox's /etc on this end: resolv.conf names its gateway (every DNS query goes to
        Aether's resolver anyway, whatever server it names)."""
        files = {"resolv.conf": f"nameserver {end.gateway}\noptions timeout:2 attempts:2\n"}
        files.update(mirrors_mod.sandbox_etc(end.gateway, set(self.mirrors)))
        return files

    def leaks(self) -> list[str]:
        """Links of this node no sandbox and no pool end holds."""
        held = ({end.ifname for end in self._pool} | {end.ifname for end, _ in self.attached.values()}
                | (set(self.links.making) | self.links.lingering(LINGER) if self.links else set()))
        # pyroute2's blocking calls must not run on a thread with a running event loop: on ours
        names = self._thread.submit(self.links.leftovers).result() if self.links else []
        return [f"veth {name}" for name in names if name not in held]


