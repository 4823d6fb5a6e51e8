"""What a trajectory record keeps of a command, env names and text (chronus/trajfit.py): always one message."""
from __future__ import annotations

import hashlib

from bus.messages import encode
from bus.records import TrajRecord
from chronus.trajfit import TRAJ_COMMAND, TRAJ_MAX, fit


def test_a_short_command_is_kept_whole_and_unmarked():
    traj = TrajRecord(id="x1", type="exec", argv=["echo", "hi"], env_keys=["A"], stdout=b"hi\n")
    assert fit(traj) == traj


def test_a_long_command_keeps_its_first_64_kib_never_half_a_character():
    words = ["printf", "\u20ac" * 30_000, "tail"]          # 90 KB of three-byte characters
    got = fit(TrajRecord(id="x2", type="exec", argv=words))
    sent = b"".join(w.encode() + b"\0" for w in words)
    assert got.command_cut and got.command_bytes == len(sent) and got.command_sha256 == hashlib.sha256(sent).hexdigest()
    assert got.argv[0] == "printf" and set(got.argv[1]) == {"\u20ac"} and len(got.argv) == 2
    assert len(b"".join(w.encode() + b"\0" for w in got.argv)) <= TRAJ_COMMAND
    script = fit(TrajRecord(id="x3", type="exec", shell="echo " + "z" * 100_000))
    assert script.command_cut and script.command_bytes == 100_005 and len(script.shell) == TRAJ_COMMAND


def test_the_worst_record_still_fits_in_one_message():
    """Control characters are 6 bytes each in JSON; the largest output the node keeps (--traj-output 256Ki of
    each stream, base64) beside them: the output goes (truncated), the record fits."""
    traj = TrajRecord(id="x4", type="exec", argv=["\x01" * 900_000], env_keys=[f"N\x02{i}" for i in range(50_000)],
                      cwd="/" + "\x03" * 100_000, detail="\x04" * 100_000, watch="/" + "\x05" * 100_000,
                      stdout=b"\xff" * (256 << 10), stderr=b"\xfe" * (256 << 10))
    assert len(encode(traj)) > 2 * TRAJ_MAX
    got = fit(traj)
    assert len(encode(got)) <= TRAJ_MAX and got.truncated and got.stdout == got.stderr == b""
    assert got.command_cut and got.command_bytes == 900_001 and len(got.cwd) == len(got.detail) == 4096
    assert len(got.watch) == 4096
