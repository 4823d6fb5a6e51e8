"""The node's pip mirror as a Flask app: proxpi's, with one file download per file at a time.

proxpi 1.3.1 (the newest) registers a file's download thread before starting it, and a second request for the
same file in that gap joins the unstarted thread: `RuntimeError: cannot join thread before it is started`,
which proxpi takes as a failed download and answers with a redirect to the upstream file. A sandbox cannot reach
the upstream (mirror-only), so its install failed: about one of 20 concurrent first installs of a wheel (CI
110). Two requests can also both find no entry and download the file twice. Here a request for a file holds
that file's lock until proxpi has it (or gave up), so the others wait for the one download and are served from
the cache. Run as `flask --app aether.pipmirror run` (aether/mirrors.py).

Sandboxes of every tenant share it, so it serves only what pip reads: GET and HEAD under /index/. proxpi's own
admin requests (`DELETE /cache/list`, `DELETE /cache/<project>`) let any sandbox empty the node's cache and send
every tenant's next install to the upstream (helper A3); they are refused with 403 here.
"""
from __future__ import annotations

import threading

from proxpi import _cache

# proxpi's own names this leans on (1.3.x; pyproject pins it below 1.4): a release without them fails here, loudly
for _name in ("_FileCache", "Cache"):
    if not hasattr(_cache, _name):
        raise ImportError(f"aether.pipmirror: proxpi._cache.{_name} is gone (proxpi changed)")
if not (hasattr(_cache._FileCache, "_get_key") and hasattr(_cache.Cache, "_file_cache_cls")):
    raise ImportError("aether.pipmirror: proxpi's file cache changed (no _get_key / _file_cache_cls)")


class OnceFileCache(_cache._FileCache):
    """proxpi's file cache, whose get() of one file runs one at a time (other files' go on in parallel)."""

    def __init__(self, *args, **kwargs) -> None:
        # per file: its lock (reentrant: proxpi's get() calls itself once started) and the gets holding or
        # awaiting it; dropped with its last get (kept, one per file ever asked for stayed for the mirror's life)
        self._once: dict[str, list] = {}
        self._once_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def get(self, url: str) -> str:
        key = self._get_key(url)
        with self._once_lock:
            held = self._once.setdefault(key, [threading.RLock(), 0])
            held[1] += 1
        try:
            with held[0]:
                return super().get(url)
        finally:
            with self._once_lock:
                held[1] -= 1
                if not held[1]:
                    del self._once[key]


_cache.Cache._file_cache_cls = OnceFileCache

from proxpi.server import app  # noqa: E402  (made after the cache class is ours: it builds its cache at import)

SERVED = ("GET", "HEAD")


def _reads_only(wsgi_app):
    """The WSGI app answering only reads of the index; anything else 403."""
    def served(environ, start_response):
        if environ.get("REQUEST_METHOD") in SERVED and environ.get("PATH_INFO", "").startswith("/index/"):
            return wsgi_app(environ, start_response)
        body = b"the node's pip mirror serves only GET and HEAD under /index/\n"
        start_response("403 Forbidden", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
        return [body]
    return served


app.wsgi_app = _reads_only(app.wsgi_app)

__all__ = ["app", "OnceFileCache"]
