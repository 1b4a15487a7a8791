"""Executors: where the samples of an ensemble run, behind one call.

:func:`run_samples` runs the samples ``indices`` of a :class:`~.sample.SampleJob`
and hands each final :class:`~.sample.SampleOutcome` (arrays, or the error of
its last try) to ``record``, in completion order. Which executor runs them
changes nothing in the outcomes:

- ``"local"``: a process pool on this machine (:func:`.pool.run_on_local_pool`);
- ``"dask"``: Dask tasks (:func:`.dask_executor.run_on_dask`) on a LocalCluster,
  SLURM or PBS batch jobs set by :class:`ClusterConfig`, or a running scheduler.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterator

from ..config import ConfigError
from .pool import run_on_local_pool
from .sample import SampleJob, SampleOutcome

EXECUTORS = ("local", "dask")
BATCH_CLUSTERS = ("slurm", "pbs")
CLUSTERS = ("local", *BATCH_CLUSTERS)
WALLTIME = re.compile(r"(\d+-)?\d+(:\d\d){0,2}")  # [D-]HH[:MM[:SS]], as SLURM and PBS take it


@dataclass(frozen=True)
class ClusterConfig:
    """Batch jobs that run Dask workers (the ``[cluster]`` table, read with ``simulate.cluster = "slurm"|"pbs"``).

    Each job asks for ``cores`` cores and ``memory`` (e.g. ``"64GB"``) for
    ``walltime`` (``"HH:MM:SS"``) on ``queue`` under ``account``, and runs one
    single-threaded worker process per core. ``job_extra_directives`` go into the
    job script's header as given (e.g. ``["--constraint=cpu"]``);
    ``job_script_prologue`` lines run before the workers start (e.g. ``["module
    load python", "source .venv/bin/activate"]``). Between ``minimum_jobs`` and
    ``maximum_jobs`` jobs run, following the load.
    """

    queue: str = ""
    account: str = ""
    cores: int = 0  # per job; 0: not set (required for slurm and pbs)
    memory: str = ""  # per job; "": not set (required for slurm and pbs)
    walltime: str = ""  # "": the queue's default
    job_extra_directives: tuple[str, ...] = ()
    job_script_prologue: tuple[str, ...] = ()
    interface: str = ""  # network interface of scheduler and workers, e.g. "ib0"; "": the default
    local_directory: str = ""  # workers' scratch directory; "": the default
    minimum_jobs: int = 0
    maximum_jobs: int = 1

    def __post_init__(self) -> None:
        rules = (
            ("cores", 0, "cores per batch job; each runs one single-threaded worker process"),
            ("minimum_jobs", 0, "batch jobs kept while idle; 0 lets the cluster shrink to nothing"),
            ("maximum_jobs", 1, "the most batch jobs at once"),
        )
        for key, least, hint in rules:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"cluster.{key}={value!r}: must be an integer ({hint})")
            if value < least:
                raise ConfigError(f"cluster.{key}={value}: must be >= {least} ({hint})")
        if self.minimum_jobs > self.maximum_jobs:
            raise ConfigError(
                f"cluster.minimum_jobs={self.minimum_jobs} exceeds cluster.maximum_jobs={self.maximum_jobs}; "
                "lower minimum_jobs or raise maximum_jobs"
            )
        if self.memory and not _is_memory(self.memory):
            raise ConfigError(f"cluster.memory={self.memory!r}: not an amount of memory; write it like \"64GB\"")
        if self.walltime and not WALLTIME.fullmatch(self.walltime):
            raise ConfigError(f"cluster.walltime={self.walltime!r}: write it as HH:MM:SS, e.g. \"02:00:00\"")


def _is_memory(text: str) -> bool:
    from dask.utils import parse_bytes

    try:
        return parse_bytes(text) > 0
    except ValueError:
        return False


def check_cluster_settings(cluster: str, cfg: ClusterConfig) -> None:
    """Raise :class:`ConfigError` if ``cluster`` ("local", "slurm", "pbs") needs settings ``cfg`` lacks."""
    if cluster not in BATCH_CLUSTERS:
        return
    if cfg.cores < 1:
        raise ConfigError(
            f"cluster.cores is required with simulate.cluster={cluster!r}: the cores of each batch job "
            "(one single-threaded worker process each); set it in the [cluster] table, e.g. cores = 32"
        )
    if not cfg.memory:
        raise ConfigError(
            f"cluster.memory is required with simulate.cluster={cluster!r}: the memory of each batch job; "
            "set it in the [cluster] table, e.g. memory = \"64GB\""
        )


def run_samples(
    job: SampleJob,
    indices: Iterator[int],
    record: Callable[[SampleOutcome], None],
    *,
    executor: str = "local",
    workers: int = 1,
    cluster: str = "local",
    scheduler_address: str = "",
    cluster_cfg: ClusterConfig | None = None,
) -> None:
    """Run the samples ``indices`` of ``job`` on ``executor``, passing each final outcome to ``record``.

    ``workers`` processes on this machine (the local pool, or a Dask
    LocalCluster); with Dask, ``scheduler_address`` connects to a running
    scheduler instead, and ``cluster="slurm"|"pbs"`` starts batch jobs set by
    ``cluster_cfg``.
    """
    if executor == "local":
        run_on_local_pool(job, indices, record, workers=workers)
    elif executor == "dask":
        from .dask_executor import run_on_dask  # distributed takes a second to import: only when used

        run_on_dask(job, indices, record, workers=workers, cluster=cluster, scheduler_address=scheduler_address,
                    cluster_cfg=cluster_cfg)
    else:
        raise ConfigError(f"simulate.executor={executor!r}: choose one of {', '.join(EXECUTORS)}")
