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


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", ["none", "placement", "edge", "server"])
def test_placement_at_scale_on_a_3_server_cluster(fault):
    """2 placement engines, 4 local edges (25 each) and 2 cloud edges on a 3-server cluster; 300 creates
    at once; with one engine, one edge or one nats-server SIGKILLed mid-burst."""
    p = subprocess.run([sys.executable, "-m", "chaos.placement_scale", "--creates", "300", "--fault", fault],
                       capture_output=True, text=True, timeout=280)
    verdict = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    assert p.returncode == 0 and verdict.endswith("PASS"), (verdict, p.stderr[-3000:])
    assert f"fault={fault} submitted=300" in verdict
    assert "lost=0 duplicated=0 leaked=0 over_capacity=0 burst_before_threshold=0" in verdict
    if fault == "none":
        assert "completed=300 failed=0" in verdict
