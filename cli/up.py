"""`dsec up`, `dsec edge`, `dsec placement`: run services in the foreground until SIGINT/SIGTERM."""
from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import os
import re
import signal
from pathlib import Path

import click

from bus.errors import BusUnavailable
from bus.kinds import KINDS, SERVED
from cli.main import DEFAULT_URL, Size, main, run_async
from edge.capacity import DEFAULT_DEBIAN, DEFAULT_PYPI, EdgeConfig


def state_dir_option(fn):
    """--state-dir, default $DSEC_STATE_DIR or .dsec in the working directory."""
    return click.option("--state-dir", type=click.Path(path_type=Path), show_default="$DSEC_STATE_DIR, else .dsec",
                        default=lambda: os.environ.get("DSEC_STATE_DIR", ".dsec"),
                        help="Where node state lives (NATS store, layer cache, writable layers).")(fn)


def edge_options(fn):
    """Options that size an edge."""
    for opt in reversed([
        click.option("--node-id", default="local", show_default=True, help="This node's id (subject token)."),
        click.option("--slots", default=0, show_default=True,
                     help="Max sandboxes on this node; 0: its memory / 1 MiB, capped by the uid ranges (28,672) and "
                          "kernel.pid_max / 2 (which caps it on a default Debian: 16,384)."),
        click.option("--capacity", default="", metavar="K=V,...",
                     help="What this node offers, overriding what is measured: slots=N, cpu=CORES, "
                          "memory=SIZE, disk=SIZE, and per backend kind KIND.slots=N (e.g. "
                          "slots=25,cpu=2,memory=4Gi,container.slots=20,fncall.slots=64; a VM kind's default is "
                          "the VMs of its least memory the node's memory holds). The overcommit "
                          "and memory fraction below still apply to cpu and memory."),
        click.option("--backend", "backends", multiple=True, metavar="KIND",
                     help="A backend kind this node runs (repeat for several: --backend container --backend "
                          "fncall). Default: every kind this machine has the tools for (container, fncall, "
                          "gvisor, ...); one of those that fails to start is left out with a warning, while "
                          "one given here that fails stops the start."),
        click.option("--fncall-workers", default=None, type=click.IntRange(1, 1024), metavar="N",
                     help="FnCall workers: exactly N (sets both --fncall-min and --fncall-max)."),
        click.option("--fncall-min", default=2, show_default=True, type=click.IntRange(0, 1024),
                     help="FnCall workers kept started when idle."),
        click.option("--fncall-max", default=32, show_default=True, type=click.IntRange(1, 1024),
                     help="FnCall workers at most (the pool grows with calls in flight, shrinks when idle)."),
        click.option("--cpu-overcommit", default=16.0, show_default=True, help="Schedulable cores per core."),
        click.option("--memory-fraction", default=0.8, show_default=True, help="Share of RAM sandboxes may book."),
        click.option("--max-output", default="64Mi", show_default=True, type=Size(),
                     help="Per-exec output cap (stdout+stderr), whatever a client asks for; past it the rest is "
                          "dropped and the exit record says truncated."),
        click.option("--layer-cache", default="16Gi", show_default=True, type=Size(),
                     help="Layers kept on this node; beyond, the least recently used that no sandbox runs on go "
                          "(fetched again when needed)."),
        click.option("--warm-max", default=32, show_default=True,
                     help="Warm-pool sandboxes this node keeps ready, all pools together (0: none; pools are set "
                          "with `dsec warm set`)."),
        click.option("--aether/--no-aether", "aether", default=True, show_default=True,
                     help="Run this node's Aether: sandbox networks (network= other than none) through its proxy "
                          "and resolver. Without it such creates are refused here."),
        click.option("--aether-dns", default="", metavar="IP[:PORT]",
                     help="The resolver Aether asks for allowed names (default: the host's first nameserver)."),
        click.option("--aether-allow-cidr", multiple=True, metavar="CIDR",
                     help="A private range sandboxes may reach when their allow list names it (repeat for several). "
                          "Private, link-local, CGNAT, metadata and IPv6 addresses are otherwise denied whatever a "
                          "tenant lists; the host's own and the sandboxes' addresses always are."),
        click.option("--mirrors/--no-mirrors", "mirrors", default=True, show_default=True,
                     help="Run this node's package mirrors with Aether (pip: proxpi; apt: apt-cacher-ng; state "
                          "under STATE_DIR): sandboxes with a network install from them, mirror-only ones from "
                          "nothing else."),
        click.option("--mirror-pypi", default=DEFAULT_PYPI, show_default=True, metavar="URL",
                     help="The simple index the pip mirror caches."),
        click.option("--mirror-apt", default=DEFAULT_DEBIAN, show_default=True, metavar="URL",
                     help="The Debian mirror the apt mirror caches: sandboxes' apt asks for deb.debian.org (and "
                          "its other names, debian-security beside it) and gets this mirror's files."),
        click.option("--lazy-layers/--no-lazy-layers", "lazy_layers", default=False, show_default=True,
                     help="Start a sandbox before this node holds its whole image: a layer's chunks are fetched as "
                          "they are read (a FUSE process per layer, each chunk checked), the rest behind them."),
        click.option("--max-paused", default=24.0, show_default=True, metavar="HOURS",
                     type=click.FloatRange(min=0, min_open=True),
                     help="How long a suspended sandbox (suspend, E2B's pause, a TTL with on_timeout=suspend) keeps "
                          "its slot and memory; then it is destroyed as expired."),
        click.option("--traj-output", default="64Ki", show_default=True, type=Size(),
                     help="Bytes of each stream kept in an exec's trajectory record, at most 256Ki (all of it is "
                          "on dsec.out while that stream keeps it)."),
    ]):
        fn = opt(fn)
    return fn


def edge_config(node_id: str, pool: str, slots: int, capacity: str, cpu_overcommit: float,
                memory_fraction: float, max_output: int | str = "64Mi", traj_output: int | str = "64Ki",
                layer_cache: int | str = "16Gi", warm_max: int = 32, backends: list[str] | None = None,
                network: dict | None = None, lazy_layers: bool = False, max_paused: float = 24.0) -> EdgeConfig:
    """An EdgeConfig from the command line; a clear error for a malformed --capacity."""
    from cli.main import fail
    from libdsec.resources import parse_size
    from bus.errors import InvalidRequest
    fields: dict = {"node_id": node_id, "pool": pool, "slots": slots, "cpu_overcommit": cpu_overcommit,
                    "memory_fraction": memory_fraction, "warm_max": warm_max, "kind_slots": {},
                    "backends": list(backends or ["container"]), "lazy_layers": lazy_layers,
                    "max_paused": max_paused * 3600.0,
                    **_network_fields(network or {})}
    if not 0 <= warm_max <= 1024:
        fail(f"--warm-max: between 0 and 1024, got {warm_max}")
    for name, value in (("max_output", max_output), ("traj_output", traj_output), ("layer_cache", layer_cache)):
        try:
            fields[name] = parse_size(value, "--" + name.replace("_", "-"))
        except (ValueError, InvalidRequest) as exc:
            fail(str(exc))
    if fields["traj_output"] > 256 << 10:   # both streams in one trajectory message (1 MiB, base64 in JSON)
        fail(f"--traj-output: at most 256Ki, got {traj_output}")
    for item in filter(None, capacity.split(",")):
        key, _, value = item.partition("=")
        try:
            if "." in key:
                kind, _, dim = key.partition(".")
                if kind not in KINDS or dim != "slots":
                    fail(f"--capacity: {key!r}: per-kind capacity is KIND.slots=N with KIND one of "
                         f"{', '.join(SERVED)}")
                fields["kind_slots"][kind] = int(value)
                if fields["kind_slots"][kind] < 0:
                    fail(f"--capacity: {key} must not be negative")
            elif key == "slots":
                fields["slots"] = int(value)
            elif key == "cpu":
                fields["cpus"] = float(value)
            elif key in ("memory", "disk"):
                fields[key] = parse_size(value, f"--capacity {key}")
            else:
                fail(f"--capacity: unknown dimension {key!r} (slots, cpu, memory, disk, KIND.slots)")
        except (ValueError, InvalidRequest) as exc:
            fail(f"--capacity: bad value for {key}: {exc}")
    if fields["slots"] < 0 or fields.get("cpus", 1) <= 0 or cpu_overcommit <= 0 or not 0 < memory_fraction <= 1:
        fail("--capacity/--slots/--cpu-overcommit/--memory-fraction must be positive (memory fraction at most 1; "
             "--slots 0: from the memory)")
    try:
        from bus import subjects
        subjects.token(node_id, "--node-id"), subjects.token(pool, "--pool")
    except ValueError as exc:
        fail(str(exc))
    return EdgeConfig(**fields)


def _network_fields(network: dict) -> dict:
    """EdgeConfig's Aether fields from --aether, --aether-dns and --aether-allow-cidr (checked)."""
    import ipaddress
    from cli.main import fail
    for cidr in network.get("aether_allow_cidr", ()):
        try:
            ipaddress.IPv4Network(cidr, strict=True)
        except ValueError as exc:
            fail(f"--aether-allow-cidr: {cidr!r} is not an IPv4 range ({exc})")
    dns = network.get("aether_dns", "")
    if dns:
        host, _, port = dns.partition(":")
        try:
            ipaddress.IPv4Address(host)
            if port and not 0 < int(port) < 65536:
                raise ValueError(port)
        except ValueError:
            fail(f"--aether-dns: an IPv4 address with an optional port, got {dns!r}")
    pypi = network.get("mirror_pypi", DEFAULT_PYPI)
    if not pypi.startswith(("http://", "https://")):
        fail(f"--mirror-pypi: an http(s) URL of a simple index, got {pypi!r}")
    apt = network.get("mirror_apt", DEFAULT_DEBIAN)
    if not re.match(r"^http://[^/\s]+(/\S*)?$", apt):
        fail(f"--mirror-apt: an http URL of a Debian mirror, got {apt!r}")
    return {"aether": network.get("aether", True), "aether_dns": dns,
            "aether_allow_cidr": list(network.get("aether_allow_cidr", ())),
            "mirrors": network.get("mirrors", True), "mirror_pypi": pypi, "mirror_apt": apt}


def backend_choice(backends: tuple[str, ...], fncall_workers: int | None, fncall_min: int,
                   fncall_max: int) -> tuple[list, list[str], frozenset[str]]:
    """(backend configs, their kinds, the kinds only found) from --backend and the fncall options: the
    kinds given, else every kind this machine has the tools for (registry.runnable)."""
    from cli.main import fail
    from edge.backends.registry import config_for, runnable
    for kind in backends:
        if kind not in KINDS:
            fail(f"--backend: unknown kind {kind!r}; the kinds are: {', '.join(SERVED)}")
    if len(set(backends)) != len(backends):
        fail("--backend: a kind is given twice")
    if fncall_workers is not None:
        fncall_min = fncall_max = fncall_workers
    if fncall_min > fncall_max:
        fail(f"--fncall-min ({fncall_min}) must not exceed --fncall-max ({fncall_max})")
    chosen = list(backends) or runnable()
    if not chosen:
        fail("no backend can run on this machine (make setup installs the container backend's tools)")
    options = {"fncall": {"workers_min": fncall_min, "workers_max": fncall_max}}
    configs = [config_for(kind, **options.get(kind, {})) for kind in chosen]
    for cfg, kind in zip(configs, chosen):
        if backends and (why := cfg.available()):
            fail(f"--backend {kind}: {why}")
    return configs, chosen, frozenset() if backends else frozenset(chosen)


def placement_options(fn):
    """Options of a placement engine."""
    for opt in reversed([
        click.option("--burst-threshold", default=0.8, show_default=True,
                     type=click.FloatRange(0, 1, min_open=True),
                     help="Local utilization past which burstable creates go to the burst pool."),
        click.option("--burst-pool", default="cloud", show_default=True, help="Pool that takes the overflow."),
        click.option("--max-waiting", default=32, show_default=True, type=click.IntRange(min=1),
                     help="Creates per priority this engine holds while they wait for room (the rest wait "
                          "in JetStream)."),
    ]):
        fn = opt(fn)
    return fn


STOP_WATCHDOG = 9.5   # seconds: a stop that has not finished by then is reported, and the process exits


def _say(message: str, err: bool = False) -> None:
    """Print a status line; a closed stdout/stderr (a reader that went away) never stops the clean-up."""
    try:
        click.echo(message, err=err)
    except OSError:
        pass


async def _serve_until_signal(stack, ready_line: str, after=None) -> None:
    """Start the stack, say ready, run after() (a coroutine function) beside it, stop at SIGINT/SIGTERM."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)   # `kill -USR1` shows where it is stuck
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stack.start()   # cleans up after itself when it fails
    extra = asyncio.ensure_future(after()) if after is not None else None
    try:
        _say(ready_line)
        waits = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(stack.broken.wait())}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
    finally:
        if extra is not None:
            extra.cancel()
            await asyncio.gather(extra, return_exceptions=True)
        _say("dsec: stopping (destroying sandboxes)", err=True)
        try:
            await asyncio.wait_for(stack.stop(), STOP_WATCHDOG)
        except asyncio.TimeoutError:
            with contextlib.suppress(OSError):
                faulthandler.dump_traceback(all_threads=True)
            _say(f"dsec: error: stop did not finish within {STOP_WATCHDOG:.0f}s; the next start of this "
                 "node reconciles what is left", err=True)
            os._exit(1)
        _say("dsec: stopped", err=True)
    if stack.broken.is_set():   # a part that cannot reach NATS again: stopped, and said (exit 1)
        raise BusUnavailable(stack.broken_reason)


@main.command()
@state_dir_option
@click.option("--nats", "nats_url", default=None, metavar="URL",
              help="Use this NATS server instead of starting the embedded one.")
@click.option("--creds", default=None, metavar="FILE",
              help="With --nats: the credential placement and the edge connect with (default: the admin's under "
                   "STATE_DIR/creds, else $DSEC_CREDS). The embedded server's are made under STATE_DIR.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the embedded NATS and metrics bind.")
@click.option("--port", default=4222, show_default=True, type=click.IntRange(1, 65535),
              help="Port of the embedded NATS server (with --servers N: the first of N consecutive ports).")
@click.option("--servers", default=1, show_default=True, type=click.IntRange(1, 7),
              help="Embedded NATS servers: 3 runs a local JetStream cluster with R3 streams (route ports are "
                   "chosen free); edges and placement elsewhere connect with the comma-separated URL list printed.")
@click.option("--metrics-port", default=9464, show_default=True, type=click.IntRange(0, 65535),
              help="Prometheus endpoint port (0: off).")
@click.option("--auth/--no-auth", default=True, show_default=True,
              help="The embedded server (each, with --servers N) enforces identities: credentials under STATE_DIR/creds (made if missing); "
                   "--no-auth lets any client act as any tenant (development only).")
@click.option("--traj-retention", default=None, type=click.FloatRange(min=0.01, max=36500),
              metavar="DAYS", help="How long DSEC_TRAJ keeps trajectory records (new streams: 30; unset: keep "
                                   "what the stream has). At least 0.01 (15 minutes).")
@click.option("--output-retention", default=None, type=click.FloatRange(min=0.05, max=87600),
              metavar="HOURS", help="How long DSEC_OUT keeps exec output; replay falls back to the part kept in "
                                    "the trajectory after that (new streams: 6; unset: keep what the stream has). "
                                    "At least 0.05 (3 minutes: past the streams' 2-minute window of duplicates, "
                                    "below which the server refuses the stream).")
@edge_options
@placement_options
@click.option("--e2b-base", "e2b_base", is_flag=True,
              help="After start, publish the `base` image (E2B's default template, edge/e2bbase.py) unless the "
                   "store has one, from /var/cache/dsec (a first build debootstraps it, about a minute). Without "
                   "it, E2B code's first Sandbox.create() builds it (libdsec.e2b).")
@click.option("-v", "--verbose", is_flag=True, help="Log at debug level.")
@run_async
async def up(state_dir: Path, nats_url: str | None, creds: str | None, host: str, port: int, servers: int, metrics_port: int, auth: bool,
             traj_retention: float | None, output_retention: float | None, node_id: str, slots: int, capacity: str,
             backends: tuple[str, ...], fncall_workers: int | None, fncall_min: int, fncall_max: int,
             cpu_overcommit: float, memory_fraction: float, max_output: int, layer_cache: int, warm_max: int,
             traj_output: int, aether: bool, aether_dns: str, aether_allow_cidr: tuple[str, ...], mirrors: bool,
             mirror_pypi: str, mirror_apt: str, lazy_layers: bool, max_paused: float, burst_threshold: float,
             burst_pool: str, max_waiting: int, e2b_base: bool, verbose: bool) -> None:
    """Run DSec on this machine in the foreground: embedded NATS with JetStream, placement, one edge
    and a metrics endpoint. Prints `dsec: ready <url>` when it can serve a create. Ctrl-C (or SIGTERM)
    destroys every sandbox and stops everything within 10 s."""
    from cli.stack import Stack
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if creds and not nats_url:
        raise click.UsageError("--creds goes with --nats (the embedded server's credentials are made under the "
                               "state dir)")
    from bus.streams import DAY, HOUR, OUT_STREAM, TRAJ_STREAM
    configs, chosen, optional = backend_choice(backends, fncall_workers, fncall_min, fncall_max)
    cfg = edge_config(node_id, "local", slots, capacity, cpu_overcommit, memory_fraction, max_output, traj_output,
                      layer_cache, warm_max, chosen, dict(aether=aether, aether_dns=aether_dns,
                                                          aether_allow_cidr=aether_allow_cidr, mirrors=mirrors,
                                                          mirror_pypi=mirror_pypi, mirror_apt=mirror_apt),
                      lazy_layers, max_paused)
    stack = Stack(state_dir, nats_url=nats_url, host=host, port=port, metrics_port=metrics_port or None,
                  edge_config=cfg, backends=configs, optional_kinds=optional, auth=auth, creds=creds,
                  placement_options=dict(burst_threshold=burst_threshold, burst_pool=burst_pool,
                                                          max_waiting=max_waiting), servers=servers,
                  stream_ages={name: age for name, age in ((TRAJ_STREAM, traj_retention and traj_retention * DAY),
                                                           (OUT_STREAM, output_retention and output_retention * HOUR))
                               if age})
    async def base_image() -> None:   # E2B's default template, for Sandbox.create() with no template
        from edge import e2bbase
        try:
            await e2bbase.ensure_published(stack.bus, lambda line: _say(f"dsec: {line}", err=True))
        except Exception as exc:   # no debootstrap, no mirror: the rest of DSec runs on
            _say(f"dsec: the E2B base image was not built ({exc}): dsec image build base --e2b-base", err=True)
    await _serve_until_signal(stack, f"dsec: ready {stack.url}", base_image if e2b_base else None)


@main.command()
@state_dir_option
@click.option("--nats", "nats_url", default=DEFAULT_URL, show_default=True, metavar="URL", help="NATS server.")
@click.option("--creds", default=None, metavar="FILE", envvar="DSEC_CREDS",
              help="This part's credential (env DSEC_CREDS; default STATE_DIR/creds/edge-<node>.creds when there).")
@click.option("--pool", default="local", show_default=True,
              help="Pool this node serves: `local` nodes are booked by placement one by one; the edges of any "
                   "other pool (e.g. `cloud`) share its lane dsec.pool.<pool>.create and take what they have room for.")
@edge_options
@click.option("-v", "--verbose", is_flag=True, help="Log at debug level.")
@run_async
async def edge(state_dir: Path, nats_url: str, creds: str | None, pool: str, node_id: str, slots: int, capacity: str,
               backends: tuple[str, ...], fncall_workers: int | None, fncall_min: int, fncall_max: int,
               cpu_overcommit: float, memory_fraction: float, max_output: int, layer_cache: int, warm_max: int,
               traj_output: int, aether: bool, aether_dns: str, aether_allow_cidr: tuple[str, ...],
               mirrors: bool, mirror_pypi: str, mirror_apt: str, lazy_layers: bool, max_paused: float,
               verbose: bool) -> None:
    """Run one edge (node agent) against an existing NATS server (a comma-separated URL list for a cluster).
    It heartbeats its capacity and usage into KV dsec-nodes and pulls only as many creates as it has room for."""
    from cli.stack import Stack
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    configs, chosen, optional = backend_choice(backends, fncall_workers, fncall_min, fncall_max)
    cfg = edge_config(node_id, pool, slots, capacity, cpu_overcommit, memory_fraction, max_output, traj_output,
                      layer_cache, warm_max, chosen, dict(aether=aether, aether_dns=aether_dns,
                                                          aether_allow_cidr=aether_allow_cidr, mirrors=mirrors,
                                                          mirror_pypi=mirror_pypi, mirror_apt=mirror_apt),
                      lazy_layers, max_paused)
    stack = Stack(state_dir, nats_url=nats_url, metrics_port=None, edge_config=cfg, run_placement=False,
                  backends=configs, optional_kinds=optional, creds=creds)
    await _serve_until_signal(stack, f"dsec: edge {node_id} ready on {nats_url}")


@main.command()
@click.option("--nats", "nats_url", default=DEFAULT_URL, show_default=True, metavar="URL", help="NATS server.")
@click.option("--creds", default=None, metavar="FILE", envvar="DSEC_CREDS",
              help="This part's credential (env DSEC_CREDS; default STATE_DIR/creds/placement.creds when there).")
@state_dir_option
@placement_options
@click.option("--metrics-port", default=0, show_default=True, type=click.IntRange(0, 65535),
              help="Prometheus endpoint port (0: off).")
@click.option("-v", "--verbose", is_flag=True, help="Log at debug level.")
@run_async
async def placement(nats_url: str, creds: str | None, state_dir: Path, burst_threshold: float, burst_pool: str, max_waiting: int,
                    metrics_port: int, verbose: bool) -> None:
    """Run one placement engine against an existing NATS server (any number may run at once, on any machine:
    they share the create consumers and book nodes by compare-and-set, so each request is placed once)."""
    from cli.stack import Stack
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    stack = Stack(state_dir, nats_url=nats_url, metrics_port=metrics_port or None, run_edge=False, creds=creds,
                  placement_options=dict(burst_threshold=burst_threshold, burst_pool=burst_pool,
                                         max_waiting=max_waiting))
    await _serve_until_signal(stack, f"dsec: placement ready on {nats_url}")
