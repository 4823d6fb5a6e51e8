"""libdsec: the DSec SDK. `AsyncClient` and its synchronous twin `Client`."""
from libdsec.calls import CallResult
from libdsec.client import AsyncClient
from libdsec.errors import (AuthenticationFailed, BusError, BusUnavailable, CapacityUnavailable, DsecError, EnvironmentFailure,
                            ExecFailed, ExecTimeout, FileOpError, ImageNotFound, InvalidRequest, OutputIncomplete,
                            PlacementError, QuotaExceeded, RateLimited, RequestExpired, SandboxError, SandboxNotFound, SandboxSuspended,
                            PermissionDenied, Unsupported)
from libdsec.network import Network
from libdsec.resources import Resources
from libdsec.exechandle import ExecHandle
from libdsec.results import ExecResult, Exit, Output
from libdsec.sandbox import AsyncSandbox
from libdsec.sync import Client, Sandbox
from libdsec.trajectories import Trajectory
from bus.records import SnapshotRecord as Snapshot

__all__ = [
    "AsyncClient", "AsyncSandbox", "AuthenticationFailed", "PermissionDenied", "BusError", "CallResult", "BusUnavailable", "CapacityUnavailable", "Client", "DsecError",
    "EnvironmentFailure", "ExecFailed", "ExecHandle", "ExecResult", "ExecTimeout", "Exit", "FileOpError", "ImageNotFound",
    "InvalidRequest", "Network", "Output", "OutputIncomplete", "PlacementError", "QuotaExceeded", "RateLimited", "RequestExpired", "Resources", "Sandbox", "SandboxError",
    "SandboxNotFound", "SandboxSuspended", "Snapshot", "Trajectory", "Unsupported",
]
