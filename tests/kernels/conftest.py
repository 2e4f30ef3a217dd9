"""The compiled ops, built once per test session."""

from __future__ import annotations

import pytest

import cuda_ext


@pytest.fixture(scope="session")
def ext_ops() -> cuda_ext.KernelOps:
    return cuda_ext.load_ops("ext")
