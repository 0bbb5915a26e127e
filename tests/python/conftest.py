"""Shared fixtures of the Python package tests (CPU, numpy)."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture(params=[np.float32, np.float16], ids=["fp32", "fp16"])
def dtype(request):
    return request.param
