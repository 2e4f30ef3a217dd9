"""Build entry points: a missing compiler is a clear error, not a traceback from ninja."""

from __future__ import annotations

import pytest

from cuda_ext import build


def test_missing_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(RuntimeError, match="C\\+\\+ compiler.*attention_backend='torch'"):
        build.require_toolchain()


def test_build_directory_honours_torch_extensions_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert build.build_directory(with_cuda=False).is_relative_to(tmp_path)
