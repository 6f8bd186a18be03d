"""Session set-up shared by every test folder (``pyproject.toml``'s ``testpaths``)."""

from __future__ import annotations

import logging

import pytest

logger = logging.getLogger(__name__)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build the CPU platform's C++ kernels once, before any test runs.

    On a fresh clone nothing is cached yet: without this, the first engine of each test
    process, and each server a test starts, builds them itself, side by side with the
    other workers' builds, and a server can miss its start-up deadline while compiling.
    Runs in the controlling process only (pytest-xdist workers find the cache filled).
    """
    if hasattr(session.config, "workerinput"):
        return
    from inference_engine.builtin.platforms.cpu import CpuPlatform
    from inference_engine.cpu_extensions import cpu_kernels_enabled

    if cpu_kernels_enabled():
        seconds = CpuPlatform().build_kernels()
        logger.info("CPU kernels ready in %.1f s", seconds)
