"""The CI soak: scripts/soak.py's mixed requests, 448 of them at concurrency 64, against
the session's server (tests/support/server.py, whose queue bound the opening burst passes). The
engine's memory is flat after ~300 requests (benchmarks/LOG.md), and the session's server has
served the other served tests' requests before this one, so the RSS check from the
midpoint (224) to the end still sees any growth; the soak by hand runs 2,000 or
more (scripts/soak.py's default), this short one keeps the suite inside CI's 15 minutes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.server import KEY, ROOT

pytestmark = pytest.mark.timeout(900)
REQUESTS = 448


def test_soak_keeps_every_promise(server, tmp_path):
    out = tmp_path / "soak.json"
    run = subprocess.run([sys.executable, "scripts/soak.py", "--url", server.url, "--key", KEY,
                          "--pid", str(server.proc.pid), "--requests", str(REQUESTS), "--concurrency", "64",
                          "--max-tokens", "6", "--max-prompt", "64",  # CI's short version: small requests
                          "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=850)
    assert out.is_file(), run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["passed"], json.dumps(result)
    assert result["completed"] + result["rejected_429"] + result["cut"] + result["invalid_4xx"] == REQUESTS
    # Each kind near its share of scripts/soak.py's mix (5% invalid bodies, ~14% cut by the
    # client, the rest valid, some of those answered 429), with room for chance.
    assert (result["completed"] > 0.58 * REQUESTS and result["invalid_4xx"] > 0.025 * REQUESTS
            and result["cut"] > 0.05 * REQUESTS), json.dumps(result)
