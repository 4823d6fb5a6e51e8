"""The exec protocol's wire messages besides the request (bus/messages.py's ExecRequest, on the op lane):
what an exec publishes on dsec.out.<tenant>.<node>.<sandbox>.<exec> (its start, its output chunks, its exit)
and what reaches a running exec on dsec.in.<node>.<tenant>.<sandbox>.<exec> (live stdin, signals)."""
from __future__ import annotations

from typing import Literal, Union

import msgspec

from bus.messages import WIRE_VERSION, Wire

# ---- output (dsec.out.<tenant>.<node>.<sandbox>.<exec>) ----------------------------------------

class StartRecord(Wire, tag="start"):
    """edge -> anyone: the command started, before any of its output (seq 1). pid: its process id in the
    sandbox's pid namespace (0: a watch, in place now; no process). Backends that cannot say publish none:
    the output then starts at seq 1."""

    exec_id: str = ""
    seq: int = 0
    pid: int = 0


class OutputChunk(Wire, tag="out"):
    """edge -> anyone: a chunk of one stream of one exec, whole lines where it can.

    seq orders all records of the exec (both streams and the exit record); stream_seq numbers the
    chunks of one stream. partial: the chunk ends inside a line (a line longer than a chunk, or one
    not finished yet) that the next chunk of the same stream continues; join them to rebuild it."""

    exec_id: str = ""
    seq: int = 0
    stream: Literal["stdout", "stderr"] = "stdout"
    data: bytes = b""
    stream_seq: int = 0
    partial: bool = False


class ExitRecord(Wire, tag="exit"):
    """edge -> anyone: the final record of an exec."""

    exec_id: str = ""
    seq: int = 0
    exit_code: int = 0
    duration: float = 0.0
    cpu_time: float = 0.0
    peak_memory: int = 0
    timed_out: bool = False
    truncated: bool = False
    error_code: str = ""      # set when the exec could not run at all (e.g. sandbox_not_found)
    error: str = ""
    reason: str = ""          # for sandbox_not_found: destroyed, expired, node_lost, never_existed
    pid: int = 0              # as its start record said (0: none)
    failure_class: str = ""   # "environment": it failed while its node's environment failed under it (a chunk of
    fault: str = ""           # a lazily loaded layer could not be read: EIO), what failed; "task": its own doing
                              # that its exit code hides (out of memory: the OOM killer chose it); "" otherwise


OutputRecord = Union[OutputChunk, StartRecord, ExitRecord]


# ---- a running exec's input (core request/reply on dsec.in.<node>.<tenant>.<sandbox>.<exec>) -------------

class ExecInput(Wire, tag="stdin"):
    """libdsec -> edge: the next piece of a live stdin (seq from 1, in order); eof closes it. Answered
    OkReply once the command's pipe took it (flow control); a repeated seq is answered, not rewritten.
    seq 0 with a piece_id: written after whatever came before, from any client (send_stdin by pid); a
    repeated piece_id is answered, not rewritten."""

    exec_id: str = ""
    seq: int = 0
    data: bytes = b""
    eof: bool = False
    piece_id: str = ""


class ExecSignal(Wire, tag="signal"):
    """libdsec -> edge: send a signal to every process of a running exec (9: kill its whole tree)."""

    exec_id: str = ""
    signal: int = 9


class ExecResize(Wire, tag="resize"):
    """libdsec -> edge: a running exec's terminal (started with pty_rows/pty_cols) now has this size."""

    exec_id: str = ""
    rows: int = 24
    cols: int = 80


ExecControlMsg = Union[ExecInput, ExecSignal, ExecResize]


# ---- the running execs of a sandbox (the op lane's ListProcesses answers with a ProcessList) ------------

class ProcessEntry(msgspec.Struct, frozen=True):
    """One running exec: its id (its output subject's last token), its pid (0: not started yet, or its
    backend does not say) and how it was started."""

    exec_id: str
    pid: int = 0
    argv: list[str] = []
    shell: str = ""
    env: dict[str, str] = {}
    cwd: str = ""
    user: str = ""
    started_at: float = 0.0
    timeout: float = 0.0
    live_stdin: bool = False
    background: bool = False


class ProcessList(msgspec.Struct, frozen=True):
    processes: list[ProcessEntry] = []


output_decoder = msgspec.json.Decoder(OutputRecord)
process_list_decoder = msgspec.json.Decoder(ProcessList)


# Output chunks travel raw: the bytes are the message payload (no JSON, no base64) and the framing is
# in NATS headers, which every NATS client reads. Start and exit records stay JSON. See docs/streams.md.
def chunk_message(c: OutputChunk) -> tuple[bytes, dict[str, str]]:
    """The payload and headers of one output chunk on dsec.out."""
    return c.data, {"Dsec-Kind": "out", "Dsec-V": str(WIRE_VERSION), "Dsec-Exec": c.exec_id, "Dsec-Seq": str(c.seq),
                    "Dsec-Stream": c.stream, "Dsec-Stream-Seq": str(c.stream_seq),
                    "Dsec-Partial": "1" if c.partial else "0"}


def decode_output(data: bytes, headers: dict[str, str] | None) -> OutputRecord:
    """An output record from a dsec.out message (raw chunk with headers, or a JSON exit record);
    msgspec.ValidationError / DecodeError for anything else."""
    if headers and headers.get("Dsec-Kind") == "out":
        try:
            stream = headers["Dsec-Stream"]
            if stream not in ("stdout", "stderr"):
                raise ValueError(stream)
            return OutputChunk(exec_id=headers.get("Dsec-Exec", ""), seq=int(headers["Dsec-Seq"]), stream=stream,
                               data=data, stream_seq=int(headers.get("Dsec-Stream-Seq", "0")),
                               partial=headers.get("Dsec-Partial") == "1")
        except (KeyError, ValueError) as exc:
            raise msgspec.ValidationError(f"bad output chunk headers: {exc}") from None
    return output_decoder.decode(data)
control_decoder = msgspec.json.Decoder(ExecControlMsg)
