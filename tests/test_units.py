"""Unit tests: parsing, validation, scoring, framing, errors, public names. No bus, no kernel."""
from __future__ import annotations

import asyncio
import importlib
import re
import time
from pathlib import Path

import msgspec
import pytest

import libdsec
from bus import errors
from bus.messages import CreateRequest, Resources, create_decoder, encode, salvage
from bus.records import Booking, NodeInfo
from bus.execwire import ExitRecord, OutputChunk, decode_output, output_decoder
from chronus import relay as relay_mod
from libdsec.execstream import LineSplitter
from libdsec.resources import parse_size
from bus import validate
from placement import scoring


def test_public_names_are_pinned():
    assert sorted(libdsec.__all__) == sorted([
        "AsyncClient", "AsyncSandbox", "AuthenticationFailed", "BusError", "CallResult", "BusUnavailable", "CapacityUnavailable", "Client", "DsecError",
        "EnvironmentFailure", "ExecFailed", "ExecHandle", "ExecResult", "ExecTimeout", "Exit", "FileOpError", "ImageNotFound",
        "InvalidRequest", "Network", "Output", "OutputIncomplete", "PlacementError", "QuotaExceeded", "RateLimited", "RequestExpired", "Resources", "Sandbox", "SandboxError",
        "PermissionDenied", "SandboxNotFound", "SandboxSuspended", "Snapshot", "Trajectory", "Unsupported"])
    for name in libdsec.__all__:
        assert getattr(libdsec, name) is not None


def test_error_tree_and_codes_round_trip():
    assert issubclass(libdsec.ExecTimeout, TimeoutError) and issubclass(libdsec.ExecTimeout, libdsec.SandboxError)
    assert issubclass(libdsec.InvalidRequest, ValueError)
    for cls in (libdsec.ImageNotFound, libdsec.InvalidRequest, libdsec.SandboxNotFound, libdsec.ExecTimeout,
                libdsec.CapacityUnavailable, libdsec.BusUnavailable):
        assert issubclass(cls, libdsec.DsecError)
        e = errors.from_code(cls.code, "m", reason="r")
        assert type(e) is cls and str(e) == "m"
    assert errors.from_code("sandbox_not_found", "x", reason="node_lost").reason == "node_lost"
    assert type(errors.from_code("no-such-code", "x")) is libdsec.DsecError


@pytest.mark.parametrize("value,expected", [("256Mi", 256 << 20), ("1Gi", 1 << 30), ("1G", 10 ** 9),
                                            ("512k", 512000), (4096, 4096), ("1.5Gi", 3 << 29)])
def test_parse_size(value, expected):
    assert parse_size(value, "resources.memory") == expected


@pytest.mark.parametrize("value", ["lots", "", "-1Mi", 0, -5, True, None, "12 parsecs"])
def test_parse_size_rejects_naming_the_field(value):
    with pytest.raises(libdsec.InvalidRequest, match="resources.memory"):
        parse_size(value, "resources.memory")


@pytest.mark.parametrize("kwargs,field", [({"cpu": -1}, "resources.cpu"), ({"cpu": 0}, "resources.cpu"),
                                          ({"pids": 0}, "resources.pids"), ({"memory": "lots"}, "resources.memory"),
                                          ({"disk": "x"}, "resources.disk")])
def test_resources_validation(kwargs, field):
    with pytest.raises(libdsec.InvalidRequest, match=field):
        libdsec.Resources(**kwargs).to_wire()


def _req(**kw) -> CreateRequest:
    base = dict(request_id="r1", sandbox_id="sb1", tenant="t", deadline=time.time() + 10, reply_to="_INBOX.x")
    base.update(kw)
    return CreateRequest(**base)


@pytest.mark.parametrize("kw,field", [
    ({"ttl": 0}, "ttl"), ({"resources": Resources(cpu=-1)}, "resources.cpu"),
    ({"resources": Resources(pids=0)}, "resources.pids"), ({"resources": Resources(memory=1)}, "resources.memory"),
    ({"sandbox_id": "a.b"}, "sandbox_id"), ({"tenant": ""}, "tenant"), ({"deadline": 0}, "deadline"),
    ({"backend": "vm"}, "backend"), ({"env": {"A=B": "x"}}, "env"),
    ({"deadline": time.time() + 7200}, "deadline"), ({"reply_to": "$JS.API.STREAM.DELETE.X"}, "reply_to"),
])
def test_admission_names_the_field(kw, field):
    with pytest.raises(libdsec.InvalidRequest, match=field):
        validate.check_create(_req(**kw))


def test_decode_errors_name_the_field_and_salvage_the_reply():
    bad = b'{"kind":"create","request_id":"r9","reply_to":"_INBOX.a.r9","resources":{"pids":"many"}}'
    with pytest.raises(msgspec.ValidationError, match=r"resources\.pids"):
        create_decoder.decode(bad)
    env = salvage(bad)
    assert (env.request_id, env.reply_to) == ("r9", "_INBOX.a.r9")
    assert salvage(b"\xff\x00junk").reply_to == ""


def _node(name, used_slots=0, slots=10, pool="local", draining=False, age=0.0):
    return NodeInfo(node=name, pool=pool, slots=slots, cpu=32, memory=8 << 30, disk=64 << 30,
                    used_slots=used_slots, max_cpu=2, max_memory=8 << 30, max_disk=64 << 30,
                    max_pids=1 << 20, draining=draining, heartbeat=time.time() - age)


def test_scoring_fits_every_dimension_and_skips_stale_draining_lost():
    nodes = [_node("a", used_slots=8), _node("b", used_slots=2), _node("c", draining=True),
             _node("d", age=60), msgspec.structs.replace(_node("e"), lost=True)]
    assert scoring.choose(nodes, Resources()) == ("a", True)           # best fit: the fuller node
    assert scoring.choose(nodes, Resources(cpu=64)) == (None, False)   # never fits any live node
    assert scoring.choose([_node("d", age=60)], Resources()) == (None, False)   # no live node
    full_mem = msgspec.structs.replace(_node("m"), used_memory=_node("m").memory - (100 << 20))
    assert scoring.choose([full_mem], Resources(memory=256 << 20)) == (None, True)   # memory is full now
    booked = msgspec.structs.replace(_node("k", used_slots=9), bookings={"r1": Booking(Resources(), time.time() + 60)})
    assert scoring.free_of(booked).slots == 0 and scoring.choose([booked], Resources()) == (None, True)


def test_scoring_least_fragmentation_prefers_balanced_leftovers():
    cpu_heavy = msgspec.structs.replace(_node("cpu"), used_cpu=31.0)          # cpu almost gone, memory free
    balanced = msgspec.structs.replace(_node("bal"), used_cpu=16.0, used_memory=_node("bal").memory // 2)
    # a memory-heavy request: on "cpu" it would strand memory; "bal" leaves both halves usable
    r = Resources(cpu=0.5, memory=1 << 30)
    assert scoring.choose([cpu_heavy, balanced], r)[0] == "bal"


def test_scoring_power_of_k_samples_at_scale():
    import random
    nodes = [_node(f"n{i}", used_slots=i % 10) for i in range(200)]
    rng = random.Random(7)
    picks = {scoring.choose(nodes, Resources(), rng=rng, k=2)[0] for _ in range(200)}
    assert len(picks) > 20, "with k=2 engines spread over many nodes instead of all choosing the one best"
    full = [_node(f"f{i}", used_slots=10) for i in range(199)] + [_node("free")]
    assert scoring.choose(full, Resources(), rng=rng)[0] == "free"    # sampling only counts fitting nodes
    assert scoring.choose(nodes[:4], Resources())[0] == "n3"           # small clusters: full scan, best fit


def test_scoring_prefers_nodes_holding_the_layers_or_a_warm_sandbox_when_close():
    import random
    from bus.messages import LayerRef
    from bus.records import layer_mark, pool_key
    layers = [LayerRef("busybox", 1, "sha256:" + "a" * 64), LayerRef("ws", 3, "sha256:" + "b" * 64)]
    prefer = scoring.affinity(layers, Resources())
    fuller, emptier = _node("fuller", used_slots=5), _node("emptier", used_slots=4)
    holder = msgspec.structs.replace(emptier, layers=[layer_mark(la.digest) for la in layers] + ["ffff"])
    half = msgspec.structs.replace(emptier, layers=[layer_mark(layers[0].digest)])
    warm = msgspec.structs.replace(_node("warm", used_slots=3), warm={pool_key(layers, Resources()): 2})
    assert scoring.choose([fuller, emptier], Resources(), prefer=prefer)[0] == "fuller"   # best fit alone
    assert scoring.choose([fuller, holder], Resources(), prefer=prefer)[0] == "emptier"   # close: no fetch wins
    assert scoring.choose([fuller, half], Resources(), prefer=prefer)[0] == "fuller"      # one layer missing
    assert scoring.choose([fuller, holder, warm], Resources(), prefer=prefer)[0] == "warm"
    far = msgspec.structs.replace(_node("far", used_slots=0), layers=holder.layers)
    assert scoring.choose([_node("tight", used_slots=9), far], Resources(), prefer=prefer)[0] == "tight"   # not close
    other = scoring.affinity(layers, Resources(cpu=2))   # another key: the warm stock does not count
    assert other(warm) == 0.0 and other(holder) == scoring.LAYER_BONUS
    many = [_node(f"n{i}", used_slots=i % 5) for i in range(200)] + [msgspec.structs.replace(warm, node="w")]
    assert scoring.choose(many, Resources(), rng=random.Random(1), prefer=prefer)[0] == "w"   # sampled or not


def test_utilization_is_the_tightest_dimension_over_live_nodes():
    nodes = [_node("a", used_slots=5), _node("b", used_slots=10), _node("c", age=60)]
    assert scoring.utilization(nodes) == pytest.approx(0.75)
    assert scoring.utilization([]) == 0.0


def test_line_splitter_keeps_streams_apart_and_flushes_partial():
    s = LineSplitter()
    assert [o.data for o in s.feed("stdout", b"a\nb")] == [b"a\n"]
    assert s.feed("stderr", b"x") == []
    assert [o.data for o in s.feed("stdout", b"c\n")] == [b"bc\n"]
    assert {(o.stream, o.data) for o in s.flush()} == {("stderr", b"x")}


class _FakeBus:
    """Records what the relay publishes (acked at once unless told to drop acks); enough for framing tests."""

    def __init__(self, drop_acks: int = 0):
        self.sent = []
        self.ids = []          # the msg id of every publish, in order
        self.drop_acks = drop_acks

    async def publish_async(self, subject, data, headers=None):
        import asyncio
        fut = asyncio.get_running_loop().create_future()
        self.ids.append(headers["Nats-Msg-Id"])
        if self.drop_acks > 0:   # published, never acked: a server dying under the connection
            self.drop_acks -= 1
        else:
            self.sent.append(decode_output(data, headers))
            fut.set_result(len(self.sent))
        return fut

    @staticmethod
    async def stored(ack, timeout):
        import asyncio
        from bus.errors import BusError
        if ack.cancelled():   # (as Bus.stored: an ack given up on before)
            raise BusError("given up on")
        try:
            return await asyncio.wait_for(ack, timeout)
        except asyncio.TimeoutError:
            raise BusError("no ack") from None

    async def publish(self, subject, data, msg_id=None):
        self.ids.append(msg_id)
        self.sent.append(output_decoder.decode(data))
        return len(self.sent)


async def test_relay_batches_orders_and_caps():
    bus = _FakeBus()
    r = relay_mod.OutputRelay(bus, "dsec.out.t.n.sb.x1", "x1", max_output=100_000)
    for i in range(1000):
        await r.sink("stdout", b"line %d\n" % i)
    await r.sink("stderr", b"err\n")
    await r.sink("stdout", b"y" * 200_000)
    rec = await r.finish(exit_code=0)
    chunks = [m for m in bus.sent if isinstance(m, OutputChunk)]
    assert len(chunks) < 10, "output must travel in chunks, not one message per line"
    assert [m.seq for m in bus.sent] == list(range(1, len(bus.sent) + 1))
    assert isinstance(bus.sent[-1], ExitRecord) and rec.truncated
    assert sum(len(c.data) for c in chunks) == 100_000
    stdout = b"".join(c.data for c in chunks if c.stream == "stdout")
    assert stdout.startswith(b"line 0\nline 1\n")
    assert b"".join(c.data for c in chunks if c.stream == "stderr") == b"err\n"


async def test_relay_publishes_an_unacked_chunk_again_and_the_exit_record_only_after_every_ack(monkeypatch):
    """A chunk whose ack never comes (its server died) is published again under the same msg id (JetStream
    stores it once), and the exit record goes out only once every chunk before it is acked."""
    monkeypatch.setattr(relay_mod, "ACK_WAIT", 0.05)
    bus = _FakeBus(drop_acks=2)
    r = relay_mod.OutputRelay(bus, "dsec.out.t.n.sb.x9", "x9", max_output=1 << 20)
    await r.sink("stdout", b"sb-x9\n")
    rec = await r.finish(exit_code=0)
    assert [type(m).__name__ for m in bus.sent] == ["OutputChunk", "ExitRecord"]
    assert bus.sent[0].data == b"sb-x9\n" and rec.seq == 2
    assert bus.ids == ["x9.1", "x9.1", "x9.1", "x9-exit"], bus.ids   # twice unacked, then stored; then the exit
    assert r.republished == 2


async def test_relay_flushes_after_a_few_ms():
    bus = _FakeBus()
    r = relay_mod.OutputRelay(bus, "dsec.out.t.n.sb.x2", "x2", max_output=1000)
    await r.sink("stdout", b"hello\n")
    import asyncio
    await asyncio.sleep(0.05)
    assert [m.data for m in bus.sent] == [b"hello\n"]
    await r.finish(exit_code=0)


async def test_relay_cuts_chunks_at_newlines_and_flags_continued_lines():
    bus = _FakeBus()
    size = relay_mod.FLUSH_BYTES
    r = relay_mod.OutputRelay(bus, "dsec.out.t.n.sb.x3", "x3", max_output=64 << 20)
    await r.sink("stdout", b"short\n" + b"L" * (3 * size) + b"\nend")   # a line longer than a chunk
    await r.sink("stderr", b"e" * 10)
    await r.sink("stdout", b"\n")
    await r.finish(exit_code=0)
    chunks = [m for m in bus.sent if isinstance(m, OutputChunk)]
    out = [c for c in chunks if c.stream == "stdout"]
    assert all(len(c.data) <= size for c in chunks)
    assert out[0].data == b"short\n" and not out[0].partial          # cut after the newline
    assert all(c.partial for c in out[1:4]) and out[4].data.endswith(b"end") and out[4].partial
    assert out[-1].data == b"\n" and not out[-1].partial
    assert [c.stream_seq for c in out] == list(range(1, len(out) + 1))
    assert [c.stream_seq for c in chunks if c.stream == "stderr"] == [1]
    assert b"".join(c.data for c in out) == b"short\n" + b"L" * (3 * size) + b"\nend\n"
    lines = LineSplitter()
    got = [o.data for c in chunks for o in lines.feed(c.stream, c.data)] + [o.data for o in lines.flush()]
    assert got == [b"short\n", b"L" * (3 * size) + b"\n", b"end\n", b"e" * 10]   # rejoined whole


async def test_relay_drains_past_the_cap_at_a_paced_rate():
    import time
    bus = _FakeBus()
    r = relay_mod.OutputRelay(bus, "dsec.out.t.n.sb.x4", "x4", max_output=10)
    await r.sink("stdout", b"x" * 10)
    t0 = time.monotonic()
    for _ in range(8):
        await r.sink("stdout", b"y" * (1 << 20))    # 8 MiB past the cap: about 8/64 s
    assert time.monotonic() - t0 >= 8 / 64 * 0.9
    assert (await r.finish(exit_code=0)).truncated


def test_encode_is_json_any_client_can_read():
    import json
    d = json.loads(encode(OutputChunk(exec_id="x", seq=1, data=b"\x00\xff")))
    assert d["kind"] == "out" and d["v"] == 1


class _OutBus:
    """DSEC_OUT for ExecStream unit tests: what the stream stores, what core delivery hands over, and reads
    back that fail `failures` times first (a leader election)."""

    def __init__(self, stored, failures=0):
        from bus.streamread import Stored
        self.stored = [Stored(i + 1, d, h) for i, (d, h) in enumerate(stored)]
        self.failures = failures
        self.reads = 0
        self.reconnect = []

    def check_credential(self):
        pass   # (the connection's credential is never refused here)

    async def subscribe(self, subject, cb, with_headers=False):
        self.cb = cb
        return self

    async def unsubscribe(self):
        pass

    def on_reconnect(self, fn):
        self.reconnect.append(fn)
        return lambda: None

    async def stored_after(self, stream, subject, seq=0):
        from bus.errors import BusError
        self.reads += 1
        if self.failures:
            self.failures -= 1
            raise BusError("stream has no leader")
        return next((m for m in self.stored if m.seq > seq), None)

    async def last_on_subject(self, stream, subject, with_headers=False):
        return (self.stored[-1].data, self.stored[-1].headers) if self.stored else None

    async def kv_get(self, bucket, key):
        return None

    async def request(self, subject, msg, timeout):
        """The control API's output-read, answered from what the fake stream stores (as placement would)."""
        from bus.apiwire import ReadOutput, StoredOutput
        from bus.messages import encode
        assert subject.endswith(".output-read") and isinstance(msg, ReadOutput)
        if msg.last:
            last = await self.last_on_subject("DSEC_OUT", subject, with_headers=True)
            return encode(StoredOutput(found=True, data=last[0], headers=dict(last[1] or {})) if last else StoredOutput())
        m = await self.stored_after("DSEC_OUT", subject, msg.after)
        return encode(StoredOutput(found=True, seq=m.seq, data=m.data, headers=dict(m.headers or {}))
                      if m else StoredOutput())


def _out(exec_id, n, exit_code=0):
    """n one-line chunks and an exit record, as dsec.out messages (payload, headers)."""
    from bus.execwire import ExitRecord, chunk_message
    msgs = [chunk_message(OutputChunk(exec_id=exec_id, seq=i, stream="stdout", data=b"%d\n" % i))
            for i in range(1, n + 1)]
    return msgs + [(encode(ExitRecord(exec_id=exec_id, seq=n + 1, exit_code=exit_code)), None)]


async def _read_all(es, wait=30):
    from bus.execwire import ExitRecord
    got = []
    async for rec in es.records(wait):
        if isinstance(rec, ExitRecord):
            return got, rec
        got.append(rec.data)


async def test_exec_stream_reads_a_lasting_gap_back_from_the_stream():
    """A chunk core delivery dropped mid-exec is read back from DSEC_OUT after a second, not at the exit."""
    import asyncio

    from libdsec.execstream import ExecStream

    stored = _out("x", 3)
    bus = _OutBus(stored[:3])
    es = ExecStream(bus, "n", "sb", "x", "")
    await es.open()
    for data, headers in (stored[0], stored[2]):        # seq 2 was dropped on the way
        await bus.cb(data, "s", headers)
    got = []

    async def read():
        async for rec in es.records(30):
            got.append(rec.data)
            if len(got) == 3:
                return
    await asyncio.wait_for(read(), 3)
    assert got == [b"1\n", b"2\n", b"3\n"]


async def test_exec_stream_retries_a_failing_read_back_and_never_fills_gaps_with_nothing():
    """The stream has the missed chunk, but the first reads fail (no leader): the reader tries again within
    its deadline and returns the exact bytes (before: the gap became b'' and exit 0)."""
    import asyncio

    from libdsec.execstream import ExecStream

    stored = _out("x", 2)
    bus = _OutBus(stored, failures=3)
    es = ExecStream(bus, "n", "sb", "x", "")
    await es.open()
    await bus.cb(*stored[0][:1], "s", stored[0][1])
    await bus.cb(stored[2][0], "s", stored[2][1])       # the exit record arrives, chunk 2 did not
    got, end = await asyncio.wait_for(_read_all(es), 5)
    assert got == [b"1\n", b"2\n"] and end.exit_code == 0 and bus.reads >= 4


async def test_exec_stream_raises_output_incomplete_when_the_stream_lacks_a_record():
    """A chunk the stream no longer holds (aged out): OutputIncomplete naming it, never fewer bytes with exit 0."""
    import asyncio

    import libdsec
    from libdsec.execstream import ExecStream

    stored = _out("x", 3)
    bus = _OutBus([stored[0], stored[2], stored[3]])    # chunk 2 is not in the stream
    es = ExecStream(bus, "n", "sb", "x", "")
    await es.open()
    for m in (stored[0], stored[2], stored[3]):
        await bus.cb(m[0], "s", m[1])
    with pytest.raises(libdsec.OutputIncomplete) as ei:
        await asyncio.wait_for(_read_all(es), 5)
    assert ei.value.missing == [2] and "records 2 of 3 are missing" in str(ei.value)


async def test_exec_stream_finds_a_result_stored_while_nothing_was_delivered(monkeypatch):
    """Every record was published while the client's connection moved: nothing arrives, yet the stored
    exit record is found (quiet probe, then a read back) long before the deadline."""
    import asyncio
    import time

    from libdsec import execstream
    from libdsec.execstream import ExecStream

    monkeypatch.setattr(execstream, "QUIET_CHECK", 0.1)
    bus = _OutBus(_out("x", 2))
    es = ExecStream(bus, "n", "sb", "x", "")
    await es.open()
    t0 = time.monotonic()
    got, end = await asyncio.wait_for(_read_all(es, wait=30), 5)
    assert got == [b"1\n", b"2\n"] and end.seq == 3 and time.monotonic() - t0 < 2


async def test_exec_stream_reads_back_after_a_reconnect():
    """A reconnect makes the reader read the stream at once (what was published meanwhile is there)."""
    import asyncio

    from libdsec.execstream import ExecStream

    bus = _OutBus(_out("x", 1))
    es = ExecStream(bus, "n", "sb", "x", "")
    await es.open()
    reader = asyncio.ensure_future(_read_all(es, wait=30))
    await asyncio.sleep(0.05)
    for fn in bus.reconnect:
        fn()
    got, end = await asyncio.wait_for(reader, 0.5)
    assert got == [b"1\n"] and end.exit_code == 0


async def test_layer_cache_keeps_under_its_cap_and_never_drops_a_layer_in_use(tmp_path, monkeypatch):
    import hashlib

    from bus.messages import LayerRef
    from edge import layercache

    monkeypatch.setattr(layercache, "KEEP_RECENT", 0.0)
    blobs = {f"sha256:{hashlib.sha256(b * 1000).hexdigest()}": b * 1000 for b in (b"a", b"b", b"c", b"d")}

    class Store:
        async def obj_get_file(self, bucket, name, path):
            path.write_bytes(blobs[name])

    in_use: set[str] = set()
    cache = layercache.LayerCache(Store(), tmp_path, max_bytes=2500, in_use=lambda: set(in_use))
    refs = [LayerRef(name=f"l{i}", version=1, digest=d, size=1000) for i, d in enumerate(blobs)]
    await cache.ensure([refs[0]])
    in_use.add(refs[0].digest)                      # a sandbox runs on the first one
    await cache.ensure([refs[1]])
    await cache.ensure([refs[2]])                   # 3000 > 2500: the oldest one not in use goes
    assert cache.path(refs[0]).exists() and not cache.path(refs[1]).exists() and cache.path(refs[2]).exists()
    assert cache.evictions == 1 and cache.size == 2000
    await cache.ensure([refs[1]])                   # fetched again when needed
    assert cache.misses == 4 and cache.path(refs[1]).exists() and not cache.path(refs[2]).exists()
    again = layercache.LayerCache(Store(), tmp_path, max_bytes=2500)   # a restart keeps what is there
    assert again.size == 2000


async def test_the_reaper_declares_no_node_lost_that_beats_or_while_it_cannot_hear_itself(monkeypatch):
    """Liveness is not one KV write: a node whose record's heartbeat is a minute old but whose core
    heartbeats are heard is alive; and an engine that does not hear its own probe (its server paused)
    judges nobody."""
    from bus.records import Heartbeat
    from placement import reaper as rmod
    from placement.ledger import NodeLedger
    monkeypatch.setattr(rmod, "SWEEP_EVERY", 0.02)
    monkeypatch.setattr(rmod, "STALL_GRACE", 1)
    ledger = NodeLedger(bus=None)
    ledger.since -= 60
    for name in ("beats", "silent"):
        ledger.on_change(name, encode(_node(name, age=60)), 1)
    r = rmod.Reaper(bus=None, ledger=ledger)
    claimed: list[str] = []

    async def claim(node):
        claimed.append(node)
        return True
    r.claim = claim
    task = asyncio.create_task(r.run())
    try:
        r.heard_self = time.monotonic() - 10          # deaf: its own probe is not coming back
        for _ in range(10):
            ledger.on_heartbeat(Heartbeat(node="beats", started_at=1.0))
            await asyncio.sleep(0.02)
        assert claimed == [], "an engine that cannot hear itself declared a node lost"
        for _ in range(20):
            r.heard_self = time.monotonic()
            ledger.on_heartbeat(Heartbeat(node="beats", started_at=1.0))
            await asyncio.sleep(0.02)
        assert claimed and set(claimed) == {"silent"}, claimed
        assert ledger.unresponsive() == frozenset(), "a beating node is bookable"
    finally:
        task.cancel()


async def test_the_reaper_gives_nodes_grace_after_its_own_stall(monkeypatch):
    from placement import reaper as rmod
    monkeypatch.setattr(rmod, "SWEEP_EVERY", 0.05)
    monkeypatch.setattr(rmod, "STALL", 0.1)
    monkeypatch.setattr(rmod, "DEAF_AFTER", 1e9)   # no probe runs here: it hears itself
    stale = _node("n", age=60)

    class Ledger:
        def nodes(self):
            return [stale]

        def silent_for(self, node):
            return 60.0
    r = rmod.Reaper(bus=None, ledger=Ledger())
    claimed: list[float] = []

    async def claim(node):
        claimed.append(time.monotonic())
        return True
    r.claim = claim
    task = asyncio.create_task(r.run())
    try:
        await asyncio.sleep(0.2)
        assert claimed, "a node silent for a minute is declared lost at once"
        time.sleep(0.5)                      # this engine's process stalls (its event loop blocked)
        await asyncio.sleep(0)
        claimed.clear()
        await asyncio.sleep(3 * 0.05)        # a few sweeps after the stall: within the grace
        assert not claimed, "declared lost on the strength of our own stall"
        for _ in range(100):                 # after STALL_GRACE sweeps on time: judged again
            if claimed:
                break
            await asyncio.sleep(0.05)
        assert claimed
    finally:
        task.cancel()


def test_terminal_escapes_controls_but_keeps_text_and_split_characters():
    """Controls (C0 but newline and tab, DEL, C1, bidi overrides) and invalid bytes show as escapes on a
    tty; a UTF-8 character split across chunks is kept whole; not a tty: bytes untouched."""
    import io
    from cli.termsafe import Terminal, escape
    assert escape("a\tb\nc\x1b[31md\x7f\u009b\u202e") == "a\tb\nc\\x1b[31md\\x7f\\x9b\\u202e"
    buf = io.BytesIO()
    t = Terminal(buf, tty=True)
    for chunk in (b"caf\xc3", b"\xa9 \xe2\x9c", b"\x93 \x1b]52;c;x\x07 \xff"):
        t.write(chunk)
    t.close()
    assert buf.getvalue() == "café ✓ \\x1b]52;c;x\\a \\xff".encode()
    raw = io.BytesIO()
    Terminal(raw, tty=False).write(b"\x1b[2J\xff")
    assert raw.getvalue() == b"\x1b[2J\xff"


def test_scoring_filters_on_the_kind_and_books_its_overhead_from_one_shared_pool():
    """A node lists the kinds it runs with slots each; all kinds share its memory, and each sandbox costs
    its kind's overhead on top of what it asks (a node full of containers has no room for a VM)."""
    from bus import kinds
    both = msgspec.structs.replace(_node("both"), backends=["container", "microvm"],
                                   kind_slots={"container": 10, "microvm": 1})
    only = msgspec.structs.replace(_node("only"), backends=["container"])
    assert scoring.choose([both, only], kinds.booked("microvm", Resources()), kind="microvm")[0] == "both"
    assert scoring.choose([only], kinds.booked("gvisor", Resources()), kind="gvisor") == (None, False)
    assert scoring.kinds_offered([both, only]) == ["container", "microvm"]
    vm = kinds.booked("microvm", Resources(memory=512 << 20))
    assert vm.memory == (512 << 20) + kinds.OVERHEAD["microvm"][0]
    full = msgspec.structs.replace(both, used_memory=both.memory - (520 << 20))   # room for 520 MiB
    assert scoring.choose([full], vm, kind="microvm")[0] is None           # 512 MiB + its overhead: no
    assert scoring.choose([full], kinds.booked("container", Resources(memory=512 << 20)))[0] == "both"
    one_vm = msgspec.structs.replace(both, kind_used={"microvm": 1})        # its microvm slot is taken
    assert scoring.choose([one_vm], kinds.booked("microvm", Resources()), kind="microvm")[0] is None
    assert scoring.choose([one_vm], Resources())[0] == "both"


def test_a_node_advertises_vm_slots_from_its_memory():
    """A VM kind's slots default to the VMs of its least memory (plus QEMU's overhead) the node's memory
    holds, not to the node's slots (16,384 microVMs on a 24 GiB node); the operator's figure wins."""
    from edge.capacity import Capacity, EdgeConfig
    cfg = EdgeConfig(memory=24 << 30, memory_fraction=0.8, slots=16384, backends=["container", "microvm", "fullvm"])
    cap = Capacity(cfg)
    assert cap.kind_slots("container") == 16384
    assert cap.kind_slots("microvm") == int((24 << 30) * 0.8) // ((128 + 96) << 20) == 87
    assert cap.kind_slots("fullvm") == int((24 << 30) * 0.8) // ((256 + 160) << 20) == 47
    assert cap.kind_slots("gvisor") == 0                                     # not run here
    assert cap.node_info().kind_slots == {"container": 16384, "microvm": 87, "fullvm": 47}
    told = Capacity(msgspec.structs.replace(cfg, kind_slots={"microvm": 120}))
    assert told.kind_slots("microvm") == 120 and told.kind_slots("fullvm") == 47
    tiny = Capacity(msgspec.structs.replace(cfg, memory=100 << 20))
    assert tiny.kind_slots("microvm") == 1      # (a create that does not fit is refused by its memory)


def test_a_vms_failure_reason_is_the_console_line_that_says_why(tmp_path):
    """Our init's or agent's last words, or the kernel's panic; not the panic that only says pid 1 ended
    (which follows our init's failure), nor a dump's last lines when there is a line that says why."""
    from edge.backends.microvm.qemu import log_tail
    log = tmp_path / "console.log"
    log.write_text("[ 1.0] booting\ndsec-init: no root device /dev/vdb\n[ 1.2] Kernel panic - not syncing: "
                   "Attempted to kill init! exitcode=0x00000100\n[ 1.3] CPU: 0 PID: 1\n[ 1.4] </TASK>\n")
    assert log_tail(log) == "dsec-init: no root device /dev/vdb"
    log.write_text("[ 2.0] sysrq: Trigger a crash\n[ 2.1] Kernel panic - not syncing: sysrq triggered crash\n"
                   "[ 2.2] RIP: 0033\n[ 2.3] </TASK>\n[ 2.4] Kernel Offset: 0x1\n")
    assert log_tail(log) == "[ 2.1] Kernel panic - not syncing: sysrq triggered crash"
    log.write_text("a\nb\nc\nd\n")
    assert log_tail(log) == "b | c | d"
    assert log_tail(tmp_path / "none") == "(no log)"


def test_the_zygote_imports_only_what_it_runs():
    """Every sandbox's init is a fork of the zygote: its fork, and the pages each child copies, grow with what
    it imported. asyncio, subprocess and threading (once pulled in through cgroups.py for enter_class) made a
    create ~1.7 ms slower (bench.cycle's create p50 14-16 ms against 12-13)."""
    import subprocess
    import sys
    code = ("import sys, edge.backends.zygote; print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'asyncio', 'subprocess', 'threading', 'concurrent', 'psutil', 'bus', 'nats', 'chronus'}))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout == "[]\n", (p.stdout, p.stderr)


def test_backend_configs_are_discriminated_and_strict(monkeypatch, tmp_path):
    from bus.errors import InvalidRequest
    from edge.backends.registry import FnCallConfig, config_for, kind_of_config
    cfg = config_for("fncall", workers_min=1, workers_max=4)
    assert isinstance(cfg, FnCallConfig) and kind_of_config(cfg) == "fncall" and cfg.workers_max == 4
    with pytest.raises(InvalidRequest, match="unknown field"):
        config_for("container", workers_max=3)
    with pytest.raises(InvalidRequest, match="container, fncall, gvisor"):
        config_for("firecracker")
    assert "not found" in config_for("microvm", qemu="no-such-qemu").available()
    assert "not found" in config_for("fullvm", qemu="no-such-qemu").available()
    monkeypatch.setenv("DSEC_VM_CACHE", str(tmp_path))   # no guest kernel there
    assert "no guest kernel" in config_for("microvm", qemu="sh").available()
    assert "no guest kernel" in config_for("fullvm", qemu="sh").available()
    (tmp_path / "kernel").mkdir()
    (tmp_path / "kernel" / "vmlinuz").write_bytes(b"")     # a kernel extracted for fewer modules: stale
    assert "lacks modules" in config_for("microvm", qemu="sh").available()
    from edge.backends.microvm import guest
    (tmp_path / "kernel" / "modules.wanted").write_text("\n".join(guest.MODULES))   # a kernel, no OS layer
    assert config_for("microvm", qemu="sh").available() == ""
    assert "no full-VM OS layer" in config_for("fullvm", qemu="sh").available()


async def test_an_unanswered_read_is_asked_again_less_and_less_often(monkeypatch):
    """A control API read with no answer is asked again after TRY_FOR, then after twice that, and so on:
    an engine slow under load is not sent the same read every TRY_FOR seconds (retry amplification)."""
    from bus.apiwire import GetQuota, QuotaState
    from libdsec import control
    monkeypatch.setattr(control, "TRY_FOR", 0.1)
    tries: list[float] = []

    class Silent:   # a bus whose requests are never answered (it stays connected)
        connected = True

        async def request(self, subject, msg, timeout):
            tries.append(timeout)
            await asyncio.sleep(timeout)
            raise errors.BusError("timeout")

    t0 = time.monotonic()
    with pytest.raises(errors.BusError, match="no answer within 1.5s"):
        await control.ask(Silent(), "t", GetQuota(), QuotaState, timeout=1.5)
    assert 1.4 < time.monotonic() - t0 < 2.0
    assert [round(t, 1) for t in tries[:3]] == [0.1, 0.2, 0.4] and len(tries) == 4, tries   # then what is left


async def test_a_read_the_engine_failed_on_the_bus_is_asked_again_and_a_change_is_not():
    """An engine whose own read of the bus failed answers a bus error (helper F3, a server of 3 killed:
    `client.list(all_states=True)` raised "kv scan ... did not answer in time"): a read is asked again
    until it is answered or its time is up; a change (not harmless twice) is not."""
    from bus.apiwire import DeleteSnapshot, Done, GetQuota, QuotaState
    from bus.messages import ErrorReply
    from libdsec import control

    class Flaky:   # a bus whose engine answers a bus error to the first two requests
        def __init__(self):
            self.asked = 0

        async def request(self, subject, msg, timeout):
            self.asked += 1
            if self.asked <= 2:
                return encode(ErrorReply(code="bus", message="kv scan sandboxes: did not answer in time"))
            return encode(QuotaState(sandboxes=7))
    bus = Flaky()
    assert (await control.ask(bus, "t", GetQuota(), QuotaState, timeout=5)).sandboxes == 7 and bus.asked == 3
    bus = Flaky()
    with pytest.raises(errors.BusError, match="did not answer in time"):
        await control.ask(bus, "t", DeleteSnapshot(), Done, timeout=5)
    assert bus.asked == 1
    t0, bus.asked = time.monotonic(), -100   # a read failing for good: its error, once its time is up
    with pytest.raises(errors.BusError, match="did not answer in time"):
        await control.ask(bus, "t", GetQuota(), QuotaState, timeout=1)
    assert 0.5 <= time.monotonic() - t0 < 1.5


async def test_dsec_node_ls_reads_the_node_records_again_when_the_bus_timed_out():
    """`dsec node ls` after a server of 3 was killed failed "kv list nodes: did not answer in time" (helper
    F3): its read is tried again for a while; a bus that is not there at all is said at once."""
    importlib.import_module("cli.main")   # (first, as the dsec command does: it loads its commands)
    from cli.admin import read_nodes

    class Moving:   # the bucket's leader moving: two reads time out
        def __init__(self, fail):
            self.fail, self.reads = fail, 0

        async def kv_items(self, bucket):
            self.reads += 1
            if self.reads <= 2:
                raise self.fail("kv list nodes: did not answer in time")
            return []
    bus = Moving(errors.BusError)
    assert await read_nodes(bus, read_for=5) == [] and bus.reads == 3
    bus = Moving(errors.BusUnavailable)
    with pytest.raises(errors.BusUnavailable):
        await read_nodes(bus, read_for=5)
    assert bus.reads == 1
    with pytest.raises(errors.BusError, match="did not answer"):
        await read_nodes(Moving(errors.BusError), read_for=0.2)


def test_favordynmods_is_read_from_mountinfo_and_can_be_declined(tmp_path, monkeypatch):
    """The cgroup2 mount's favordynmods: kept when on, nothing done without a cgroup2 mount or when
    declined (DSEC_FAVOR_DYNMODS=0); never a mount call in these cases."""
    from edge.backends import hosttables, kernel
    calls = []
    monkeypatch.setattr(kernel, "mount", lambda *a: calls.append(a))
    on = tmp_path / "on"
    on.write_text("30 25 0:26 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw,nsdelegate,favordynmods\n")
    none = tmp_path / "none"
    none.write_text("31 25 0:27 / /sys/fs/cgroup/freezer rw - cgroup cgroup rw,freezer\n")
    off = tmp_path / "off"
    off.write_text("30 25 0:26 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw,nsdelegate\n")
    assert hosttables.favor_dynmods(str(on)) is True
    assert hosttables.favor_dynmods(str(none)) is False
    monkeypatch.setenv("DSEC_FAVOR_DYNMODS", "0")
    assert hosttables.favor_dynmods(str(off)) is False
    assert calls == []
    monkeypatch.delenv("DSEC_FAVOR_DYNMODS")
    assert hosttables.favor_dynmods(str(off)) is True   # remounted with the options it had, plus favordynmods
    assert calls == [("cgroup2", "/sys/fs/cgroup/unified", "cgroup2", kernel.MS_REMOUNT, "nsdelegate,favordynmods")]


async def test_a_quiet_agent_channel_holds_every_frame_until_its_agent_speaks_again():
    """Before a VM's memory is saved (edge/backends/microvm/memory.py) nothing may reach the agent after its
    'Q': a frame sent meanwhile (here a credit) is held and follows the 'U'. A fork's 'U' with detach
    numbers the channel's next exec above the highest id the agent still holds."""
    import os
    import socket
    import struct
    from edge.backends.gvisor.agent import HEAD, AgentChannel

    host, agent = socket.socketpair()
    agent.setblocking(False)
    r = host.detach()
    chan = AgentChannel("sb-q", os.dup(r), r)
    chan.ready.set_result(None)
    loop = asyncio.get_running_loop()

    async def frame() -> tuple[str, int, bytes]:
        head = await asyncio.wait_for(loop.sock_recv(agent, HEAD.size), 5)
        length, kind, xid = HEAD.unpack(head)
        body = await loop.sock_recv(agent, length - 5) if length > 5 else b""
        return chr(kind), xid, body

    def answer(xid: int, extra: bytes = b"") -> None:
        body = struct.pack("<I", 0) + extra
        agent.send(HEAD.pack(5 + len(body), ord("H"), xid) + body)
    try:
        quiet = asyncio.ensure_future(chan.quiesce())
        kind, xid, _ = await frame()
        assert kind == "Q"
        chan._send(b"G", 7, struct.pack("<I", 4096))       # e.g. credit for output consumed meanwhile
        answer(xid)
        await quiet
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(loop.sock_recv(agent, 1), 0.2)    # held: nothing after the 'Q'
        woken = asyncio.ensure_future(chan.release(detach=True))
        kind, xid, body = await frame()
        assert (kind, body) == ("U", b"\1")
        assert (await frame())[:2] == ("G", 7)              # the held frame, after the 'U'
        answer(xid, struct.pack("<I", 41))
        await woken
        assert chan._next == 41                             # the next exec is 42: above the agent's old ones
        chan._send(b"G", 8, struct.pack("<I", 1))
        assert (await frame())[:2] == ("G", 8)              # and frames go straight out again
    finally:
        chan.close()
        agent.close()


def test_a_fork_from_memory_is_pinned_to_its_node_and_must_match_the_snapshot():
    from bus.errors import InvalidRequest
    from bus.messages import CreateRequest, Resources
    from bus.records import SnapshotRecord
    from placement.engine import _memory_pin
    snap = SnapshotRecord(id="snap1", memory_node="n1", memory_kind="microvm", resources=Resources(memory=256 << 20))
    req = CreateRequest(snapshot="snap1", memory=True, backend="microvm", resources=Resources(memory=256 << 20))
    assert _memory_pin(req, snap) == "n1"
    assert _memory_pin(msgspec.structs.replace(req, memory=False, backend="container"), snap) == ""
    for bad, why in ((msgspec.structs.replace(req, backend="fullvm"), "not a fullvm"),
                     (msgspec.structs.replace(req, resources=Resources(memory=512 << 20)), "fixes the resources")):
        with pytest.raises(InvalidRequest, match=why):
            _memory_pin(bad, snap)
    with pytest.raises(InvalidRequest, match="has no memory"):
        _memory_pin(req, msgspec.structs.replace(snap, memory_node=""))


def test_a_restored_vms_stub_kernel_keeps_the_header_and_drops_the_payload():
    """QEMU holds a -kernel's payload in its own memory (~13.5 MiB of Debian's cloud kernel per VM): a restore,
    whose RAM holds its booted kernel already, gets the real boot header and setup code with 4 KiB of it."""
    from edge.backends.microvm.guest import GuestError, stub_kernel
    setup = bytearray(512 * 8)
    setup[0x1f1] = 7                        # setup sectors after the boot sector
    setup[0x202:0x206] = b"HdrS"
    image = bytes(setup) + b"\x90" * (13 << 20)
    stub = stub_kernel(image)
    assert stub == image[:8 * 512 + 4096]
    with pytest.raises(GuestError, match="bzImage"):
        stub_kernel(b"\x7fELF" + bytes(8192))


@pytest.mark.parametrize("entry,why", [
    ("*", "allowing everything"), ("*.org", "a wildcard must name a domain"), ("pypi.*", "not a host name"),
    ("Py Pi.org", "not a host name"), ("pypi..org", "not a host name"), ("pypi.org:http", "bad port"),
    ("pypi.org:70000", "ports are 1-65535"), ("pypi.org:443-80", "ports are 1-65535"), ("10.0.0.1/33", "10.0.0.1/33"),
    ("198.51.100.1/24", "host bits set"), ("2001:db8::/32", "in brackets"), ("[2001:db8::/32", "IPv6 range is written"),
    ("1.2.3", "does not appear to be an IPv4"), ("", "non-empty"), ("a" * 64 + ".org", "not a host name"),
])
def test_a_malformed_network_entry_is_refused_naming_it(entry, why):
    from bus.errors import InvalidRequest
    from bus.network import parse_entry
    with pytest.raises(InvalidRequest, match=re.escape(why)):
        parse_entry(entry)


def test_network_entries_parse_and_match_as_documented():
    import ipaddress
    from bus.errors import InvalidRequest
    from bus.network import Network, check, matches, parse_entry
    exact, wild, net, v6 = (parse_entry(e) for e in ("PyPI.org", "*.pythonhosted.org:443", "198.51.100.0/24:8000-8100",
                                                       "[2001:db8::/32]:443"))
    assert matches(exact, "pypi.org", None, 443) and matches(exact, "pypi.org.", None, 80)
    assert not matches(exact, "pypi.org", None, 22) and not matches(exact, "evil-pypi.org", None, 443)
    assert matches(wild, "files.pythonhosted.org", None, 443) and matches(wild, "a.b.pythonhosted.org", None, 443)
    assert not matches(wild, "pythonhosted.org", None, 443) and not matches(wild, "files.pythonhosted.org", None, 80)
    assert not matches(wild, "pythonhosted.org.evil.com", None, 443)
    assert matches(net, None, ipaddress.ip_address("198.51.100.9"), 8050)
    assert not matches(net, None, ipaddress.ip_address("198.51.101.9"), 8050)
    assert not matches(net, "198.51.100.9", None, 8050)            # a name is never taken for an address
    assert matches(v6, None, ipaddress.ip_address("2001:db8::1"), 443)
    assert check(Network(mode="proxied", allow=["pypi.org"] * 256)).allow == ["pypi.org"] * 256
    for bad, why in ((Network(mode="none", allow=["pypi.org"]), "takes no allow list"),
                     (Network(mode="proxied", bandwidth=-1), "bandwidth"),
                     (Network(mode="proxied", max_connections=70000), "max_connections")):
        with pytest.raises(InvalidRequest, match=why):
            check(bad)


def test_default_slots_come_from_memory_capped_by_uid_ranges_and_pids():
    from edge.backends import hosttables, idmap
    from edge.capacity import default_slots
    pids = hosttables.node_tasks(lifted=True) // 2
    assert default_slots(8 << 30) == (min(8192, pids, idmap.COUNT), "memory" if 8192 <= min(pids, idmap.COUNT)
                                      else ("pids" if pids < idmap.COUNT else "uid ranges"))
    slots, cap = default_slots(1 << 50)                  # memory plenty: a kernel limit caps it
    assert cap in ("pids", "uid ranges") and slots == min(pids, idmap.COUNT)
    assert default_slots(512 << 10) == (1, "memory")      # never 0


async def test_launcher_sends_that_wait_for_room_together_all_go_out():
    """Creates that find the zygote's socket full at once each wait for room; every one is sent when it
    frees (one add_writer per fd: a second waiter's callback replaced the first's, whose create hung)."""
    import socket
    from edge.backends.launcher import Launcher
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.setblocking(False)
    theirs.setblocking(False)
    launcher = Launcher()
    launcher.sock, launcher.death = ours, None
    try:
        filled = 0
        while True:
            try:
                ours.send(b"f" * 4096)
                filled += 1
            except BlockingIOError:
                break
        senders = [asyncio.create_task(launcher._send(b"s%d" % i * 1000, [])) for i in range(4)]
        await asyncio.sleep(0.05)
        assert not any(t.done() for t in senders), "the socket was full: they wait"
        got: list[bytes] = []
        deadline = time.monotonic() + 5
        while len(got) < filled + 4 and time.monotonic() < deadline:
            try:
                got.append(theirs.recv(1 << 16))
            except BlockingIOError:
                await asyncio.sleep(0.01)
        await asyncio.wait_for(asyncio.gather(*senders), 2)
        assert sorted(m[:2] for m in got[filled:]) == [b"s0", b"s1", b"s2", b"s3"], got[filled:]
    finally:
        ours.close()
        theirs.close()


def test_sandbox_cgroups_are_spread_over_the_node_shards():
    """A sandbox's groups sit in one of SHARDS groups by its key, at the same relative path in every
    hierarchy (lxcfs reads the cpu quota at the cpuset path), and its execs' below them; a batch sandbox's
    in the node's batch tree, the same way."""
    from edge.backends import cgroups
    node = cgroups.NodeCgroups.__new__(cgroups.NodeCgroups)
    node.node_id, node.base = "n", {c: cgroups.ROOT / c / "dsec-n" for c in cgroups.CONTROLLERS}
    node.batch = {c: cgroups.ROOT / c / "dsec-n.batch" for c in cgroups.CONTROLLERS}
    node._batch_cpu, node._has_batch, node.trees = str(node.batch["cpu"]), False, (node.base, node.batch)
    keys = [f"sb{i:016x}" for i in range(400)]
    shards = {cgroups.shard(k) for k in keys}
    assert len(shards) == cgroups.SHARDS and cgroups.shard(keys[0]) == cgroups.shard(keys[0])
    groups = node.sandbox(keys[0])
    rel = {str(p.relative_to(cgroups.ROOT / c)) for c, p in groups.items()}
    assert rel == {f"dsec-n/{cgroups.shard(keys[0])}/{keys[0]}"}
    assert all(p.parent == groups[c] for c, p in node.exec_group(keys[0], 3).items())
    assert set(node.exec_join(keys[0], 3)) == {*node.exec_group(keys[0], 3).values(),
                                                *(p for c, p in groups.items() if c not in cgroups.EXEC_CONTROLLERS)}
    rel = {str(p.relative_to(cgroups.ROOT / c)) for c, p in node.sandbox(keys[0], batch=True).items()}
    assert rel == {f"dsec-n.batch/{cgroups.shard(keys[0])}/{keys[0]}"}


def test_etc_hosts_names_the_sandbox_keeps_the_images_lines_and_never_follows_or_waits(tmp_path):
    import os
    from edge.backends import hostsfile
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    hosts = root / "etc/hosts"
    hosts.write_bytes(b"127.0.0.1 localhost\n127.0.1.1   debian\n10.0.0.5 db # the image's\n127.0.1.10 other")
    assert hostsfile.name_host(str(root), "sb1", os.getuid())
    assert hosts.read_bytes() == (b"127.0.0.1 localhost\n10.0.0.5 db # the image's\n127.0.1.10 other\n"
                                  b"127.0.1.1\tsb1\n")
    assert hostsfile.name_host(str(root), "sb2", os.getuid())          # a claim renames: one line, the new name
    assert hosts.read_bytes().count(b"127.0.1.1\t") == 1 and hosts.read_bytes().endswith(b"127.0.1.1\tsb2\n")
    assert oct(hosts.stat().st_mode & 0o777) == "0o644" and not (root / "etc/.hosts.dsec").exists()
    hosts.unlink()                                                     # none: the plain localhost lines
    assert hostsfile.name_host(str(root), "sb3", os.getuid())
    assert hosts.read_bytes() == hostsfile.PLAIN + b"127.0.1.1\tsb3\n"
    secret = tmp_path / "secret"
    secret.write_bytes(b"host's own\n")
    hosts.unlink()
    hosts.symlink_to(secret)                                           # the image's symlink: left alone
    assert not hostsfile.name_host(str(root), "sb4", os.getuid())
    assert secret.read_bytes() == b"host's own\n" and hosts.is_symlink()
    hosts.unlink()
    os.mkfifo(hosts)                                                   # a FIFO: no wait, left alone
    assert not hostsfile.name_host(str(root), "sb5", os.getuid())
    hosts.unlink()
    hosts.write_bytes(b"127.0.0.1 localhost\n")
    (root / "etc/.hosts.dsec").mkdir()                                 # the image's odd name: no failure
    assert not hostsfile.name_host(str(root), "sb5", os.getuid())
    assert hosts.read_bytes() == b"127.0.0.1 localhost\n"
    (root / "etc/.hosts.dsec").rmdir()
    hosts.write_bytes(b"#" * hostsfile.MAX_BYTES)                      # past 16 KiB: left alone
    assert not hostsfile.name_host(str(root), "sb6", os.getuid())
    (root / "etc").rename(root / "real-etc")
    (root / "etc").symlink_to(tmp_path)                                # /etc itself a symlink: left alone
    assert not hostsfile.name_host(str(root), "sb7", os.getuid()) and not (tmp_path / "hosts").exists()


async def test_a_chunk_whose_send_was_cancelled_is_published_before_the_exit_record():
    """The bus is away while a chunk is flushed and the flush is cancelled (the command's pipes are given up
    on at its kill): the chunk had taken its seq, so it is published later, before the exit record (before:
    never, and the exit record came after a hole the SDK reported as output aged out of the stream)."""
    import asyncio
    from bus.errors import BusError
    bus = _FakeBus()
    real, away = bus.publish_async, [True]

    async def maybe(subject, data, headers=None):
        if away[0]:
            raise BusError("publish: not connected")
        return await real(subject, data, headers)
    bus.publish_async = maybe
    r = relay_mod.OutputRelay(bus, "dsec.out.t.n.sb.x7", "x7", max_output=1 << 20)
    data = b"kept\n" * (relay_mod.FLUSH_BYTES // 2)   # three chunks' worth: the 2nd and 3rd had no seq yet
    flushing = asyncio.ensure_future(r.sink("stdout", data))   # the command's pump: flushes at once
    await asyncio.sleep(0.2)                 # retrying its send while the bus is away
    flushing.cancel()
    await asyncio.gather(flushing, return_exceptions=True)
    away[0] = False
    rec = await asyncio.wait_for(r.finish(exit_code=-1), 10)
    assert [m.seq for m in bus.sent] == list(range(1, rec.seq + 1)) and rec.seq >= 4, [m.seq for m in bus.sent]
    assert b"".join(m.data for m in bus.sent[:-1]) == data   # every byte, in order, once


async def test_a_chunk_cancelled_while_waiting_for_window_room_keeps_its_seq(monkeypatch):
    """The pumps are given up on while a flush waits for room in the window (acks not coming: a stopped
    server): the record that took its seq there is kept, published before the exit record (no hole)."""
    import asyncio
    monkeypatch.setattr(relay_mod, "ACK_WAIT", 0.05)
    monkeypatch.setattr(relay_mod, "WINDOW_CHUNKS", 1)
    bus = _FakeBus(drop_acks=10_000)
    r = relay_mod.OutputRelay(bus, "dsec.out.t.n.sb.x8", "x8", max_output=1 << 20)
    data = b"line\n" * (relay_mod.FLUSH_BYTES // 2)   # three chunks: the 2nd waits for the 1st's ack
    pumping = asyncio.ensure_future(r.sink("stdout", data))
    await asyncio.sleep(0.3)
    pumping.cancel()
    await asyncio.gather(pumping, return_exceptions=True)
    bus.drop_acks = 0
    rec = await asyncio.wait_for(r.finish(exit_code=-1), 10)
    assert [m.seq for m in bus.sent] == list(range(1, rec.seq + 1)), [m.seq for m in bus.sent]
    assert b"".join(m.data for m in bus.sent[:-1]) == data


async def test_an_exec_request_never_taken_ends_at_its_start_deadline_and_a_refusal_at_once():
    """_send_until_taken: a bus that never acks: BusError once the start deadline is near (not a wait of the
    exec's whole timeout); a refused credential: raised at once, not retried."""
    import time
    from bus.errors import AuthenticationFailed, BusError
    from libdsec import sandbox as sandbox_mod

    class Away:
        class nc:
            is_closed = False
        calls = 0

        async def publish(self, *args, **kwargs):
            Away.calls += 1
            raise self.error
    away = Away()
    away.error = BusError("publish: NATS did not answer in time")
    t0 = time.monotonic()
    with pytest.raises(BusError, match="will not run"):
        await sandbox_mod._send_until_taken(away, "s", b"d", "x1", time.time() + 0.3)
    assert time.monotonic() - t0 < 2 and Away.calls >= 1
    away.error, Away.calls = AuthenticationFailed("revoked"), 0
    with pytest.raises(AuthenticationFailed):
        await sandbox_mod._send_until_taken(away, "s", b"d", "x1", time.time() + 30)
    assert Away.calls == 1


def test_the_server_keeper_restarts_for_room_only_after_a_full_disk(tmp_path):
    """keep() restarts nats-server after a logged write error only when it was for want of room (a restart
    heals that once the disk has room again) and only what was logged since its start; an I/O error or a
    read-only disk would come back at once, and restarting for them every few seconds dropped every client."""
    from bus.server import NatsServer
    srv = NatsServer(tmp_path / "nats", log_file=tmp_path / "nats-server.log")
    (tmp_path / "nats").mkdir()
    old = b"[1] [ERR] Filestore [A] Critical write error: write x.blk: no space left on device\n"
    srv.log_file.write_bytes(old)
    srv._log_seen = len(old)                  # (as _spawn sets it: what was there before is not looked at)
    with open(srv.log_file, "ab") as f:
        f.write(b"[2] [ERR] Filestore [B] Critical write error: write y.blk: input/output error\n")
    assert srv._logged_write_error() == ""
    with open(srv.log_file, "ab") as f:
        f.write(b"[2] [INF] fine\n[2] [ERR] JetStream stream 'DSEC > C' critical write error: write z.blk: "
                b"no space left on device\n[2] [ERR] half a li")
    assert srv._logged_write_error().endswith("z.blk: no space left on device")
    assert srv._logged_write_error() == ""   # read once; the half line waits for its end
    assert srv._room()                        # (this disk has room)


def test_own_mounts_keeps_what_it_is_asked_for_and_what_that_lies_under(tmp_path):
    """kernel.own_mounts (a VM's QEMU, the keeper's maker): a kept mount nested in another keeps its parent
    (detaching the parent took the kept one with it: review R); every other host mount is gone."""
    import subprocess
    import sys
    for d in ("a", "a/b", "c", "c/d"):
        (tmp_path / d).mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(tmp_path / d)], check=True)
    try:
        code = ("import sys; from edge.backends import kernel; kernel.own_mounts([sys.argv[1], '/proc']); "
                "print('\\n'.join(kernel.mount_points()))")
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "a" / "b")], capture_output=True, text=True,
                             check=True, cwd=str(Path(__file__).parent.parent)).stdout.split()
        assert str(tmp_path / "a") in out and str(tmp_path / "a" / "b") in out and "/" in out, out
        assert not any(p.startswith(str(tmp_path / "c")) for p in out), out
    finally:
        for d in ("c/d", "c", "a/b", "a"):
            subprocess.run(["umount", str(tmp_path / d)], check=False)


def test_a_snapshot_tag_is_a_name_not_a_line_or_an_id():
    """A tag with a newline split `dsec snapshot ls` rows; one shaped like a snapshot id was shadowed by
    that id, then named another snapshot once the id was gone; 5,000 characters were echoed back (C)."""
    from bus.errors import InvalidRequest
    from bus.validate import check_tag
    for ok in ("", "step-1", "v1.2:rc_3", "a" * 128):
        check_tag(ok)
    for bad in ("a\nb", "abc\n", "snap6f752a44259ccba6", "bad tag!", "x" * 5000, 5):
        with pytest.raises(InvalidRequest) as ei:
            check_tag(bad)
        assert len(str(ei.value)) < 200


async def test_a_call_is_refused_unsent_only_when_placement_says_no_node_runs_fncall():
    """A call asks placement once (backends-get) whether some live node runs fncall workers, and fails at once
    only on its word that none does: with no answer (placement down, slow, rate-limited), or an engine that
    has not read the node records yet, the call goes to the nodes' lane as it always did (calls do not go
    through placement). Either answer is kept a few seconds, for the calls after it."""
    from bus.apiwire import Backends
    from libdsec import calls

    class Client:
        def __init__(self, answer) -> None:
            self._fncall, self.answer, self.asked = calls.Offered(), answer, 0

        async def _ask(self, _request, _expect, timeout=0.0):
            self.asked += 1
            if isinstance(self.answer, Exception):
                raise self.answer
            return self.answer
    for answer in (errors.BusUnavailable("no engine"), errors.BusError("no answer"), errors.RateLimited("slow down"),
                   Backends(kinds=[], known=False), Backends(kinds=["container", "fncall"])):
        c = Client(answer)
        await asyncio.gather(*(calls._need_fncall(c) for _ in range(20)))   # (concurrent calls: asked once)
        await calls._need_fncall(c)
        assert c.asked == 1, answer
    c = Client(Backends(kinds=["container"]))
    for _ in range(2):   # a no is asked again each time (a node may have come)
        with pytest.raises(errors.CapacityUnavailable, match="no node runs fncall workers"):
            await calls._need_fncall(c)
    assert c.asked == 2


async def test_a_live_index_still_loading_is_waited_for_not_started_again(monkeypatch):
    """A load of the live index longer than a second (helper S2's 80,000 records take about 4 s): a read that
    found it behind after 1 s started it afresh, so under lists polled each second it never ended (helper
    29). Now it is started afresh only when its watch went silent; readers wait while it delivers, and each
    gets the index once it reaches the sequence the bucket had when the read began."""
    from bus.records import SandboxRecord
    from placement import listing
    target = 300

    class Bus:
        async def kv_last_seq(self, _bucket):
            return target

        async def stored_after(self, *_a):
            return object()   # (more stored: the index is behind)
    index = listing.LiveIndex(Bus())

    async def load() -> None:   # a watch delivering the bucket's records over 1.5 s
        for seq in range(1, target + 1):
            rec = SandboxRecord(sandbox_id=f"sb{seq}", tenant="acme", state="ready")
            index._on_change(f"acme.sb{seq}", encode(rec), seq)
            await asyncio.sleep(0.005)
    loading = asyncio.ensure_future(load())
    reads = await asyncio.gather(*(index.records("acme") for _ in range(5)))
    await loading
    assert not index._restart.is_set() and index.fallbacks == 0
    assert all(len(r) == target for r in reads)
    monkeypatch.setattr(listing, "RELOAD", 1.5)   # a watch gone silent short of the bucket: started afresh, then
    target = 301                                   # the read goes to the bucket when the wait runs out
    assert await index.records("acme") is None and index._restart.is_set() and index.fallbacks == 1


async def test_provisioning_waits_for_a_server_that_does_not_answer_yet_and_not_for_a_refusal(monkeypatch):
    """After a 3-server cluster's restart its streams' leaders come seconds after the meta leader: one try per
    stream left `dsec up --servers 3` unable to start on its own state (helper F3). Unanswered requests are
    asked again for PROVISION_WAIT seconds; a refusal is raised at once."""
    import nats.errors
    import nats.js.errors
    from bus import provision
    calls = []

    async def late():
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise nats.errors.TimeoutError
        return "made"
    p = provision.Provisioning()
    assert await p._patiently("stream X", late) == "made" and len(calls) == 3

    async def refused():
        calls.append(0)
        raise nats.js.errors.BadRequestError(code=400, description="no")
    calls.clear()
    with pytest.raises(errors.BusError, match="stream Y"):
        await p._patiently("stream Y", refused)
    assert len(calls) == 1
    monkeypatch.setattr(provision, "PROVISION_WAIT", 0.6)

    async def never():
        raise nats.js.errors.ServiceUnavailableError(code=503, description="JetStream system temporarily unavailable")
    t0 = time.monotonic()
    with pytest.raises(errors.BusError, match="stream Z"):
        await p._patiently("stream Z", never)
    assert 0.2 < time.monotonic() - t0 < 2


async def test_an_answer_waits_for_its_record_until_its_callers_deadline_and_only_its_own():
    """record_wait: RECORD_WAIT without a deadline; the deadline less REPLY_MARGIN (at least 0.2 s, at most
    RECORD_WAIT_MAX) with one; an op's deadline (ANSWERING_BY) counts in the task answering it only, not in a
    task or callback made meanwhile (a sandbox's death watcher a rollback registered: review R5)."""
    from edge import sandboxes as sbx
    now = time.time()
    assert sbx.record_wait() == sbx.RECORD_WAIT
    assert 28.5 < sbx.record_wait(now + 30) <= 29.0
    assert sbx.record_wait(now - 5) == 0.2 and sbx.record_wait(now + 3600) == sbx.RECORD_WAIT_MAX
    token = sbx.ANSWERING_BY.set((now + 20, asyncio.current_task()))
    try:
        assert 18.5 < sbx.record_wait() <= 19.0

        async def inherited() -> float:
            return sbx.record_wait()
        assert await asyncio.ensure_future(inherited()) == sbx.RECORD_WAIT
    finally:
        sbx.ANSWERING_BY.reset(token)
    assert sbx.record_wait() == sbx.RECORD_WAIT


async def test_a_create_given_up_on_is_watched_while_its_record_may_still_come(monkeypatch):
    """A create whose time ran out: with no record 1 s past its deadline and the bus answering, none ever
    comes (a node claims before it starts); once a read of its record failed, or while it is starting, it is
    watched, and destroyed once it is up (helper F4: 18 sandboxes ran on, unseen, until their TTL)."""
    from bus.records import SandboxRecord
    from libdsec import creating
    monkeypatch.setattr(creating, "SETTLE_EVERY", 0.01)
    monkeypatch.setattr(creating, "SETTLE_SLOWLY", 0.05)
    monkeypatch.setattr(creating, "ABANDON_AFTER", 3.0)
    destroyed: list[str] = []

    async def destroy(sandbox_id, node):
        destroyed.append(sandbox_id)
    watch = creating.GivenUp(None, destroy)

    def script(*steps):
        it = iter(steps)

        async def record(sandbox_id):
            step = next(it, steps[-1])
            if isinstance(step, Exception):
                raise step
            return None if step is None else msgspec.structs.replace(
                SandboxRecord(sandbox_id=sandbox_id, node="n1"), state=step)
        return record
    t0 = time.time()
    watch.record = script(None)
    await watch.when_settled("sb-never", t0)   # no record, the bus answering: done 1 s past the deadline
    assert 1.0 <= time.time() - t0 < 1.5 and destroyed == []
    late = time.time()   # a warm claim's `ready` record, stored 1.5 s past the deadline, after a failed read

    async def record_late(sandbox_id):
        if not calls:
            calls.append(1)
            raise errors.BusError("no answer")
        return (None if time.time() < late + 1.5
                else msgspec.structs.replace(SandboxRecord(sandbox_id=sandbox_id, node="n1"), state="ready"))
    calls: list[int] = []
    watch.record = record_late
    await watch.when_settled("sb-late", late)
    assert destroyed == ["sb-late"] and time.time() - late >= 1.5
    watch.record = script("starting", "starting", "destroyed")
    await watch.when_settled("sb-ended", time.time())
    assert destroyed == ["sb-late"]


def test_the_pip_mirrors_per_file_locks_serialise_one_file_and_go_with_their_last_get(tmp_path, monkeypatch):
    """One download per file at a time (proxpi's own race, CI 110); and a file's lock goes with its last get:
    one per file ever asked for was kept for the mirror's life."""
    import threading
    from aether import pipmirror
    from proxpi import _cache
    inside: dict[str, int] = {}
    most: dict[str, int] = {}
    guard = threading.Lock()

    def fake_get(self, url):   # proxpi's download, slow enough for the gets to overlap
        with guard:
            inside[url] = inside.get(url, 0) + 1
            most[url] = max(most.get(url, 0), inside[url])
        time.sleep(0.02)
        with guard:
            inside[url] -= 1
        return "/cache/" + url.rsplit("/", 1)[-1]
    monkeypatch.setattr(_cache._FileCache, "get", fake_get)
    cache = pipmirror.OnceFileCache(1 << 20, str(tmp_path))
    urls = [f"http://upstream.test/files/pkg-{i % 5}.whl" for i in range(40)]
    threads = [threading.Thread(target=cache.get, args=(u,)) for u in urls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most == {f"http://upstream.test/files/pkg-{i}.whl": 1 for i in range(5)}   # one at a time per file
    assert cache._once == {}


def test_the_sync_api_has_every_call_of_the_async_one():
    """libdsec.Client / Sandbox / ExecHandle are "the same API" (README): every public call of the async classes
    has its twin, but connect (the sync client connects when made) and feed (an async iterable)."""
    import libdsec
    from libdsec import sync
    from libdsec.exechandle import ExecHandle
    for asynchronous, synchronous, apart in ((libdsec.AsyncClient, sync.Client, {"connect"}),
                                             (libdsec.AsyncSandbox, sync.Sandbox, set()),
                                             (ExecHandle, sync.ExecHandle, {"feed"})):
        names = {n for n in dir(asynchronous) if not n.startswith("_")}
        assert names - apart <= set(dir(synchronous)), (synchronous.__name__, names - apart - set(dir(synchronous)))


async def test_a_cluster_serves_on_while_a_majority_of_its_servers_run():
    """helper-42: one server of three restarted three times within a minute (keep() gave up on it) stopped the whole
    `dsec up --servers 3`, its sandboxes destroyed, though the other two held the majority. Now that member stays
    down and the stack goes on; it is broken once fewer than a majority run (the single server: at once)."""
    import types
    from cli.stack import Stack

    class Server:
        def __init__(self, gives_up_after=None):
            self.after = gives_up_after

        async def keep(self):
            if self.after is None:
                await asyncio.Event().wait()   # runs on
            await asyncio.sleep(self.after)
            return f"server gave up at {self.after}"

    def stack(servers, single=None):
        return types.SimpleNamespace(cluster=types.SimpleNamespace(servers=servers) if servers else None,
                                     server=single, broken=asyncio.Event(), broken_reason="")
    one_down = stack([Server(0.01), Server(), Server()])
    task = asyncio.ensure_future(Stack._keep_server(one_down))
    await asyncio.sleep(0.3)
    assert not one_down.broken.is_set() and not task.done()   # two of three serve on
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    two_down = stack([Server(0.01), Server(0.05), Server()])
    await asyncio.wait_for(Stack._keep_server(two_down), 5)
    assert two_down.broken.is_set() and two_down.broken_reason == "server gave up at 0.05"
    alone = stack([], single=Server(0.01))
    await asyncio.wait_for(Stack._keep_server(alone), 5)
    assert alone.broken.is_set() and alone.broken_reason == "server gave up at 0.01"
