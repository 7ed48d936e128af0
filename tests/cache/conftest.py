"""Every cache test runs on the CPU engine (and where CUDA exists on the CUDA stream engine too), and on
two event loops: asyncio's own and uvloop's, the ids saying which.

Async tests get their loop from pytest-asyncio's ``pytest_asyncio_loop_factories`` hook; synchronous
tests (which start their own loops with ``asyncio.run``) get the same two through the ``cache_loop``
parameter, which sets the event loop policy for the test's duration.
"""

from __future__ import annotations

import asyncio
import inspect

import pytest
import uvloop

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
_POLICIES = {"asyncio": asyncio.DefaultEventLoopPolicy, "uvloop": uvloop.EventLoopPolicy}


def pytest_asyncio_loop_factories(config, item):
    return LOOPS


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if not inspect.iscoroutinefunction(metafunc.function):
        metafunc.fixturenames.append("cache_loop")
        metafunc.parametrize("cache_loop", list(LOOPS), indirect=True)


@pytest.fixture
def cache_loop(request):
    """The loop kind a synchronous test's ``asyncio.run`` gets (its name)."""
    old = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(_POLICIES[request.param]())
    try:
        yield request.param
    finally:
        asyncio.set_event_loop_policy(old)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> str:
    return request.param
