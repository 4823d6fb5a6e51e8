"""The wire messages of stateless calls (fncall): one request, one reply (or an ErrorReply)."""
from __future__ import annotations

from typing import Union

import msgspec

from bus.messages import ErrorReply, Resources, Wire


class CallRequest(Wire, tag="call"):
    """libdsec -> any fncall node (dsec.call.<priority>.<tenant>): run one stateless call. call_id is the
    Nats-Msg-Id; the node answers reply_to once with a CallReply or an ErrorReply."""

    call_id: str = ""
    tenant: str = "default"
    image: str = "busybox"
    argv: list[str] = []
    shell: str = ""                  # a string command: run by the trusted shell
    env: dict[str, str] = {}
    cwd: str = "/tmp"
    stdin: bytes = b""
    files: dict[str, bytes] = {}     # written before the command runs
    read_back: list[str] = []        # read after it, into CallReply.files
    timeout: float = 10.0
    resources: Resources = Resources()
    labels: dict[str, str] = {}      # `job` names its trajectory timeline
    max_output: int = 256 << 10      # bytes kept per stream
    deadline: float = 0.0            # absolute: a call still waiting then is not run (CapacityUnavailable)
    reply_to: str = ""
    sent_at: float = 0.0


class CallReply(Wire, tag="callresult"):
    """A fncall node -> the caller: how the call ended."""

    call_id: str = ""
    exit_code: int = 0
    stdout: bytes = b""
    stderr: bytes = b""
    duration: float = 0.0
    cpu_time: float = 0.0
    peak_memory: int = 0
    timed_out: bool = False
    truncated: bool = False
    files: dict[str, bytes] = {}
    unread: dict[str, str] = {}      # read_back paths not read back (not there, not a file, no room) -> why
    worker: str = ""
    node: str = ""
    waited: float = 0.0              # seconds from sent to started on the worker


call_decoder = msgspec.json.Decoder(CallRequest)
call_reply_decoder = msgspec.json.Decoder(Union[CallReply, ErrorReply])
