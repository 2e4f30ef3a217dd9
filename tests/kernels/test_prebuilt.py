"""A runtime image loads kernels built in its build stage (PAGEDSERVE_KERNELS_LIB), with no compiler."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cuda_ext import build

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# In a fresh interpreter: the ops come from the given library, checked against the pure-torch reference.
_CHECK = """
import torch
from cuda_ext import reference
from cuda_ext.ops import load_ops
ops = load_ops("ext")
cache = torch.randn(6, 2, 2, 3, 4, 8)
expected = cache.clone()
mapping = torch.tensor([[0, 4], [2, 5]], dtype=torch.int64)
ops.copy_blocks(cache, mapping)
reference.copy_blocks(expected, mapping)
assert torch.equal(cache, expected)
print("ok")
"""


def _run(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _CHECK], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT, "CXX": "/nonexistent/c++", **env})


def test_a_prebuilt_library_loads_without_a_compiler(tmp_path) -> None:
    out = tmp_path / "kernels.so"
    assert build.main(["--library-out", str(out)]) == 0  # a cached build, or one built now (with the compiler)
    result = _run({build.PREBUILT_ENV: str(out), "TORCH_EXTENSIONS_DIR": str(tmp_path / "empty")})
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
    assert not (tmp_path / "empty").exists()  # nothing built, nothing written


def test_a_missing_prebuilt_library_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(RuntimeError, match="--library-out"):
        build.load_prebuilt(tmp_path / "missing.so")


@pytest.mark.slow
def test_without_the_library_a_build_still_needs_a_compiler(tmp_path) -> None:
    if build.builds_cuda():
        pytest.skip("checks the CPU build")
    result = _run({"TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert result.returncode != 0 and "C++ compiler" in result.stderr
