"""Every cache test runs on the CPU engine; where CUDA exists, also on the CUDA stream engine."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> str:
    return request.param
