"""The chaos scenarios, run as a user runs them: each must print a PASS verdict."""
from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.timeout(240)
def test_edge_killed_mid_burst_verdict():
    p = subprocess.run([sys.executable, "-m", "chaos.edge_restart", "--creates", "24"], capture_output=True,
                       text=True, timeout=220)
    verdict = p.stdout.strip().splitlines()[-1]
    assert p.returncode == 0 and verdict.startswith("verdict: submitted=24") and verdict.endswith("PASS"), \
        (verdict, p.stderr[-2000:])
    assert "lost=0 duplicated=0 leaked=0 served_after_restart=4/4" in verdict
