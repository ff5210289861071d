"""Shared test set-up: one thread per process, and a reaper that ends only this run's own child processes."""

import contextlib
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import psutil  # noqa: E402
import pytest  # noqa: E402


def pytest_configure(config):
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:  # pragma: no cover
        pass


@pytest.fixture(scope="session", autouse=True)
def reap_children():
    """After the session, terminate (then kill) any process this test run started and left behind, by PID."""
    yield
    children = psutil.Process().children(recursive=True)
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.terminate()
    _, alive = psutil.wait_procs(children, timeout=5)
    for child in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
