"""The SDK's errors: one tree rooted at DsecError (defined once in bus.errors, re-exported here)."""
from bus.errors import (AuthenticationFailed, BusError, BusUnavailable, CapacityUnavailable, DsecError, EnvironmentFailure, ExecFailed,
                        ExecTimeout, FileOpError, ImageNotFound, InvalidRequest, OutputIncomplete, PlacementError,
                        QuotaExceeded, RateLimited, RequestExpired, SandboxError, SandboxNotFound, SandboxSuspended,
                        PermissionDenied, Unsupported)

__all__ = ["AuthenticationFailed", "BusError", "BusUnavailable", "CapacityUnavailable", "DsecError", "EnvironmentFailure", "ExecFailed",
           "ExecTimeout", "FileOpError", "ImageNotFound", "InvalidRequest", "OutputIncomplete", "PlacementError",
           "QuotaExceeded", "RateLimited", "RequestExpired", "SandboxError", "SandboxNotFound", "SandboxSuspended", "PermissionDenied", "Unsupported"]
