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


def _is_torch_helper(process: psutil.Process) -> bool:
    try:
        return process.name().startswith("torch_shm_manag")
    except psutil.NoSuchProcess:
        return True


@pytest.fixture(scope="session", autouse=True)
def reap_children():
    """After the session, terminate (then kill) any process this test run started and left behind, by PID.

    torch's shared-memory manager is spared: it is torch's own helper, it exits by itself once this process is
    gone, and killing it early makes the tensors freed at interpreter exit abort the process (broken pipe).
    """
    yield
    children = [p for p in psutil.Process().children(recursive=True) if not _is_torch_helper(p)]
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.terminate()
    _, alive = psutil.wait_procs(children, timeout=5)
    for child in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()


@pytest.fixture
def procs(tmp_path):
    """Start peers as real processes (:class:`tests.helpers.swarm.Procs`); all stopped by PID at the end."""
    from tests.helpers.swarm import Procs

    procs = Procs(tmp_path)
    try:
        yield procs
    finally:
        procs.stop_all()


@pytest.fixture
def reader(tmp_path):
    """This test's own peer: ``reader(run_id, initial_peers)`` joins and returns a Swarm and a BlobService."""
    made = []

    def join(run_id: str, initial_peers=()):
        from peer.network.blobs import BlobCache, BlobService
        from peer.network.swarm import NetworkConfig, join

        swarm = join(NetworkConfig.loopback(initial_peers), run_id)
        blobs = BlobService(swarm.dht, BlobCache(tmp_path / f"reader-{run_id}"))
        made.append((swarm, blobs))
        return swarm, blobs

    try:
        yield join
    finally:
        for swarm, blobs in made:
            blobs.close()
            swarm.shutdown()
