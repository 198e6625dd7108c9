"""scripts/gpu_check.sh on a machine without a GPU: it starts, says so and stops cleanly,
leaving its log where $OUT points (on a lent device the same command runs every check)."""

from __future__ import annotations

import os
import subprocess
import sys


from tests.support.server import ROOT


def test_gpu_check_reports_no_cuda_device_cleanly(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    run = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "no CUDA device" in run.stdout and "Traceback" not in run.stdout + run.stderr
    assert "no CUDA device" in (tmp_path / "gpu_check.log").read_text()
