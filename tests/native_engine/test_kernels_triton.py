"""Triton kernels against the torch reference: the cases are in triton_kernel_cases.py.

The CPU interpreter (TRITON_INTERPRET=1) must be on before triton decorates the kernels and
stays on for the whole process, so the cases run in a child pytest and cannot leak into the
rest of the suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

CASES = Path(__file__).with_name("triton_kernel_cases.py")


def test_triton_kernels_against_reference() -> None:
    """Run the kernel cases in a child pytest: under the interpreter on CPU, on the GPU when
    there is one. One OpenMP thread: the child only checks values, and on a shared 2-core box
    torch's threads contend (small ops measured ~50x slower under load with 2 threads)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)],
        cwd=root, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout, proc.stdout[-3000:]
    assert " skipped" not in proc.stdout, proc.stdout[-3000:]
