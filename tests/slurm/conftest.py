"""A real single-node Slurm cluster for the session (scripts/slurm/localhost-cluster.sh).

A cluster already answering in the state directory ($CONVERGE_SLURM_DIR, else
/tmp/converge-slurm) is used and left running; otherwise the fixture starts one
(installing slurm-wlm and munge with apt, as root, if missing) and stops it at the
end. Where Slurm is missing and cannot be installed (not root, no apt, apt failed),
the tests that need it skip with that reason.
"""
from __future__ import annotations

from typing import Iterator

import pytest

from benchmarks.slurm_check import DEFAULT_DIR, LocalSlurm, SlurmUnavailable


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slurm: runs jobs on the local Slurm cluster (skips where none can run)")


@pytest.fixture(scope="session")
def slurm() -> Iterator[LocalSlurm]:
    cluster = LocalSlurm(DEFAULT_DIR)
    started_here = not cluster.answers()
    if started_here:
        try:
            cluster.start()
        except SlurmUnavailable as err:
            pytest.skip(f"no Slurm cluster: {err}")
    try:
        cluster.wait_until_idle()
        yield cluster
    finally:
        if started_here:
            cluster.stop()


@pytest.fixture()
def idle_slurm(slurm: LocalSlurm) -> LocalSlurm:
    """The cluster once the jobs of an earlier test have left the queue."""
    slurm.wait_until_idle()
    return slurm
