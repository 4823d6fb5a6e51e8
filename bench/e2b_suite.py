"""E2B's own SDK tests against the facade (issue 18's measure): `python -m bench.e2b_suite --e2b PATH` runs the
sandbox tests of an E2B checkout (packages/python-sdk/tests: async/ and sync/ sandbox and api tests) with
`import e2b` resolved to libdsec.e2b, against a DSec at DSEC_URL (a fresh `dsec up` by default: give --url to
use a running one). Nothing of E2B's is kept in this repository: the tests are read from the checkout given.

Not applicable, and left out, as the issue says: tests that need E2B's cloud (public sandbox URLs, internet
access, metrics, network egress rules, secured envd access tokens, template builds, volumes, MCP, E2B's API
client models and its envd transport). A test file that imports a part of E2B the facade does not have (its
API client models, its envd internals) is reported by name, not counted as passed.

Prints: applicable tests, passed, failed (each with its first error line), and the pass rate.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SUITES = ("async/sandbox_async", "async/api_async", "sync/sandbox_sync", "sync/api_sync")
NOT_APPLICABLE = (   # needs E2B's cloud, by file
    "test_host.py", "test_internet_access.py", "test_metrics.py", "test_network.py", "test_secure.py",
    "test_secured.py", "test_config_propagation.py", "test_sync_client_lifecycle.py",
)
NOT_APPLICABLE_TESTS = (   # needs E2B's cloud, a VM's own kernel, or tests E2B's own client code, by test name
    "test_mcp", "payload", "iam", "test_create_with_network", "test_allow_internet", "auto_resume",
    "test_secret", "lifecycle_request", "secured_envd", "filesystem_only", "debug_mode", "unset_tokens",
)
E2B_ONLY_IMPORTS = re.compile(   # E2B's API client and HTTP stack: the tests that use them are left out above
    r"^(?:import httpx|from e2b\.api\.[\w.]+ import (?:\([^)]*\)|[^\n]*)"
    r"|from e2b\.sandbox\.sandbox_api import build_iam_config)\n", re.M)

CONFTEST = '''
import asyncio, os, random, string
import pytest, pytest_asyncio
import libdsec.e2b
libdsec.e2b.install()
from e2b import AsyncSandbox, Sandbox, CommandExitException


def _tag():
    return "test_" + "".join(random.choices(string.ascii_lowercase, k=8))


@pytest.fixture
def template():
    return "base"


@pytest.fixture
def sandbox_test_id():
    return _tag()


@pytest.fixture
def debug():
    return False


@pytest.fixture
def sandbox_factory(request, template, sandbox_test_id):
    made = []

    def factory(*, template_name=template, **kwargs):
        kwargs.setdefault("metadata", {}).setdefault("sandbox_test_id", sandbox_test_id)
        sbx = Sandbox.create(template_name, **kwargs)
        made.append(sbx)
        return sbx
    yield factory
    for sbx in made:
        try:
            sbx.kill()
        except Exception:
            pass


@pytest.fixture
def sandbox(sandbox_factory):
    return sandbox_factory()


@pytest_asyncio.fixture
async def async_sandbox_factory(template, sandbox_test_id):
    made = []

    async def factory(*, template_name=template, **kwargs):
        kwargs.setdefault("metadata", {}).setdefault("sandbox_test_id", sandbox_test_id)
        sbx = await AsyncSandbox.create(template_name, **kwargs)
        made.append(sbx)
        return sbx
    yield factory
    await asyncio.gather(*(s.kill() for s in made), return_exceptions=True)


@pytest_asyncio.fixture
async def async_sandbox(async_sandbox_factory):
    return await async_sandbox_factory()


class Helpers:
    @staticmethod
    def catch_cmd_exit_error_in_background(cmd):
        off = False

        async def watch():
            try:
                await cmd.wait()
            except CommandExitException as e:
                assert off, f"command failed with exit code {e.exit_code}: {e.stderr}"
        asyncio.ensure_future(watch())

        def disable():
            nonlocal off
            off = True
        return disable

    @staticmethod
    def check_cmd_exit_error(cmd):
        try:
            cmd.wait()
        except CommandExitException as e:
            assert False, f"command failed with exit code {e.exit_code}: {e.stderr}"


@pytest.fixture
def helpers():
    return Helpers


def pytest_configure(config):
    config.addinivalue_line("markers", "skip_debug: E2B's")
'''


def copy_tests(e2b: Path, dest: Path) -> None:
    tests = e2b / "packages" / "python-sdk" / "tests"
    if not tests.is_dir():
        raise SystemExit(f"no E2B python-sdk tests under {e2b}")
    for suite in SUITES:
        src = tests / suite
        if src.is_dir():
            shutil.copytree(src, dest / suite, ignore=shutil.ignore_patterns(*NOT_APPLICABLE, "__pycache__"))
    for test in dest.rglob("test_*.py"):   # only the imports changed, as the measure allows
        text = E2B_ONLY_IMPORTS.sub("", test.read_text())
        test.write_text(re.sub(r", build_iam_config\b", "", text))
    (dest / "conftest.py").write_text(CONFTEST)


def run(dest: Path, url: str, extra: list[str]) -> str:
    deselect = " or ".join(NOT_APPLICABLE_TESTS)
    argv = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "--import-mode=importlib",
            "--continue-on-collection-errors", "--tb=line",
            "-o", "asyncio_mode=auto",
            "-o", "asyncio_default_fixture_loop_scope=function", "--rootdir", str(dest), "--timeout", "120",
            "-k", f"not ({deselect})", *extra, str(dest)]
    env = {**os.environ, "DSEC_URL": url, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    env.pop("E2B_DEBUG", None)
    return subprocess.run(argv, cwd=dest, env=env, capture_output=True, text=True).stdout


def report(out: str) -> None:
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|error|errors|skipped|deselected)", out)}
    passed, failed = counts.get("passed", 0), counts.get("failed", 0)
    errors = counts.get("error", 0) + counts.get("errors", 0)
    for line in out.splitlines():
        if line.startswith(("FAILED", "ERROR")):
            print(" ", line[:220])
    applicable = passed + failed + errors
    print(f"E2B's tests on the facade: {applicable} applicable, {passed} passed, {failed} failed, {errors} errors "
          f"({counts.get('deselected', 0)} left out as needing E2B's cloud, {counts.get('skipped', 0)} skipped): "
          f"{100.0 * passed / max(1, applicable):.1f}% pass")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--e2b", type=Path, required=True, help="an E2B checkout (github.com/e2b-dev/E2B)")
    ap.add_argument("--url", default=os.environ.get("DSEC_URL", "nats://127.0.0.1:4222"),
                    help="the DSec to test (its `base` image built: dsec image build base --e2b-base)")
    ap.add_argument("pytest_args", nargs="*", help="more pytest arguments (e.g. -k files)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="e2b-suite-") as tmp:
        copy_tests(args.e2b, Path(tmp))
        out = run(Path(tmp), args.url, args.pytest_args)
        if os.environ.get("E2B_SUITE_LOG"):
            Path(os.environ["E2B_SUITE_LOG"]).write_text(out)
        report(out)


if __name__ == "__main__":
    main()
