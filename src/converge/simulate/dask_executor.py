"""The Dask executor: samples as Dask tasks on a LocalCluster, batch jobs or a running scheduler.

Each sample is one task whose key is a hash of what makes it (app class, app
config, schema, seed, index), so submitting it again is idempotent: a scheduler
that holds the task, running or done, does not run it twice. At most
``TASKS_PER_THREAD`` tasks per worker thread are in flight; results stream back
as they finish (:class:`distributed.as_completed`) and are handed on one by one,
never gathered.

Failures, and how they become the same records as on the local pool:

- a sample that raises is retried by Dask (``retries``); the outcome of its last
  try (:class:`SampleFailed` carries it) is recorded;
- a worker that dies loses only its tasks, which the scheduler runs elsewhere.
  A task held by more dying workers than the scheduler's ``allowed-failures``
  (3 by default) ends in :class:`~distributed.KilledWorker`; Dask charges every
  task a dying worker held, so that sample is a mere suspect: it runs again
  alone on the cluster (:class:`~.pool.RetryQueue`, as on the local pool), and
  only if it then ends in ``KilledWorker`` again is it recorded as
  :data:`~.pool.WORKER_DIED`.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from concurrent.futures import CancelledError
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator, NamedTuple

import dask
from distributed import Client, Future, KilledWorker, LocalCluster, WorkerPlugin, as_completed

from ..config import to_dict
from .executors import ClusterConfig, check_cluster_settings
from .pool import THREAD_VARIABLES, WORKER_DIED, RetryQueue, init_worker, one_thread_per_worker
from .sample import SampleJob, SampleOutcome, describe, simulate_sample

TASKS_PER_THREAD = 4  # in flight per worker thread: no worker waits for the next task, the client holds few results
THREADS_REFRESH_S = 2.0  # how often to ask the scheduler how many worker threads it has
CONNECT_TIMEOUT_S = 30  # to reach an existing scheduler
# Environment of worker processes this run starts, set before they start. Dask's default sets
# MALLOC_TRIM_THRESHOLD_=65536; any value turns off glibc's adaptive mmap threshold, so numpy
# temporaries are mapped afresh each time: the chem app's DFT ran 30-40% slower here. None unsets it.
WORKER_ENVIRON: dict[str, str | None] = {"MALLOC_TRIM_THRESHOLD_": None, **{v: "1" for v in THREAD_VARIABLES}}


# -- tasks ------------------------------------------------------------------------------
class SampleFailed(Exception):
    """A sample raised in its app: Dask retries the task; the last try's outcome is the failure record."""

    def __init__(self, outcome: SampleOutcome) -> None:
        super().__init__(outcome)

    @property
    def outcome(self) -> SampleOutcome:
        return self.args[0]

    def __str__(self) -> str:
        return f"sample {self.outcome.index}: {self.outcome.error}"


def simulate_sample_or_raise(
    app_cls: type, app_cfg: Any, schema: dict[str, Any], seed: int, index: int
) -> SampleOutcome:
    """:func:`~.sample.simulate_sample`, raising :class:`SampleFailed` when a retry could help."""
    outcome = simulate_sample(app_cls, app_cfg, schema, seed, index)
    if outcome.error is not None and outcome.retry:
        raise SampleFailed(outcome)
    return outcome


def sample_keys(job: SampleJob) -> Callable[[int], str]:
    """The Dask key of each sample of ``job``: a hash of everything that makes the sample."""
    inputs = {
        "app": f"{job.app_cls.__module__}.{job.app_cls.__qualname__}", "app_config": to_dict(job.app_cfg),
        "schema": job.schema, "seed": job.seed,
    }
    prefix = json.dumps(inputs, sort_keys=True, default=repr)

    def key(index: int) -> str:
        return "simulate_sample-" + hashlib.sha256(f"{prefix}\nindex={index}".encode()).hexdigest()[:32]

    return key


def dask_outcome(future: Future, index: int) -> SampleOutcome:
    """The outcome of the ``future`` that ran sample ``index``, whatever ended it.

    Waits if the worker holding the result died since the task finished (Dask
    then computes it again).
    """
    try:
        return future.result()
    except SampleFailed as err:
        return err.outcome
    except KilledWorker:
        return SampleOutcome(index, None, None, WORKER_DIED, retry=True)
    except CancelledError:
        raise RuntimeError(
            f"Dask cancelled sample {index}: the scheduler or the connection to it went away; "
            "rerun the same command to resume (complete shards are kept)"
        ) from None
    except Exception as err:  # e.g. a result that cannot be pickled
        return SampleOutcome(index, None, None, describe(err))


# -- the run ----------------------------------------------------------------------------
def run_on_dask(
    job: SampleJob,
    indices: Iterator[int],
    record: Callable[[SampleOutcome], None],
    *,
    workers: int,
    cluster: str = "local",
    scheduler_address: str = "",
    cluster_cfg: ClusterConfig | None = None,
) -> None:
    """Run the samples ``indices`` of ``job`` as Dask tasks, passing each final outcome to ``record``.

    Dask retries a failing sample itself (``job.retries``); the queue only runs
    a sample alone once it was on too many dying workers (see the module's doc).
    """
    queue = RetryQueue(indices, retries=0)
    with dask_client(cluster, scheduler_address, workers, cluster_cfg or ClusterConfig()) as dask_run:
        client, threads = dask_run.client, WorkerThreads(dask_run.client, dask_run.planned_threads)
        key = sample_keys(job)
        in_flight: dict[Future, int] = {}
        finished = as_completed()

        def submit_more() -> None:
            limit = 1 if queue.exclusive else TASKS_PER_THREAD * threads()
            while len(in_flight) < limit and (index := queue.next()) is not None:
                alone = "-alone" if index == queue.on_trial else ""  # its first key erred: a new one
                future = client.submit(
                    simulate_sample_or_raise, *job.task_args(index), key=key(index) + alone, retries=job.retries,
                )
                in_flight[future] = index
                finished.add(future)

        submit_more()
        for future in finished:
            index = in_flight.pop(future)
            outcome = dask_outcome(future, index)
            if queue.settle(outcome, culprit_known=index == queue.on_trial):
                record(outcome)
            submit_more()


class WorkerThreads:
    """How many worker threads to keep busy: the planned cluster size, or what joined the scheduler."""

    def __init__(self, client: Client, planned: int) -> None:
        self.client = client
        self.planned = planned
        self.joined = 0
        self.checked_at = -float("inf")

    def __call__(self) -> int:
        if time.monotonic() - self.checked_at > THREADS_REFRESH_S:
            self.joined = sum(self.client.nthreads().values())
            self.checked_at = time.monotonic()
        return max(self.planned, self.joined, 1)


# -- where the workers come from --------------------------------------------------------
class DaskRun(NamedTuple):
    """A client of the run's scheduler, and how many worker threads the cluster will have."""

    client: Client
    planned_threads: int  # 0: as many as join an existing scheduler


class OneThreadPerWorker(WorkerPlugin):
    """One torch/BLAS thread per worker thread (:func:`~.pool.init_worker`), on every worker, even late ones.

    Workers of a cluster this run starts also get the thread variables before
    they start (numpy reads them when loaded); this covers torch, and workers
    someone else started.
    """

    idempotent = True
    name = "converge-one-thread-per-worker"

    def setup(self, worker: Any) -> None:
        init_worker()


def scheduler_settings() -> dict[str, Any]:
    """Dask settings for a scheduler and workers this run starts.

    A worker's death charges every task it held, innocent or not; one task per
    worker thread at a time (saturation 1.0, rather than Dask's 1.1) keeps that
    to the sample that was running while the scheduler queues the rest. A
    worker then waits a round trip (about a millisecond) for its next task.
    Worker processes start with :data:`WORKER_ENVIRON`.
    """
    environ = dask.config.get("distributed.nanny.pre-spawn-environ", {})
    return {
        "distributed.scheduler.worker-saturation": 1.0,
        "distributed.nanny.pre-spawn-environ": {**environ, **WORKER_ENVIRON},
    }


@contextmanager
def dask_client(cluster: str, scheduler_address: str, workers: int, cluster_cfg: ClusterConfig) -> Iterator[DaskRun]:
    """Connect to the scheduler at ``scheduler_address``, or start ``cluster``; close what was started."""
    with ExitStack() as stack:
        if scheduler_address:
            try:
                client = stack.enter_context(Client(scheduler_address, timeout=CONNECT_TIMEOUT_S))
            except OSError as err:  # TimeoutError included
                raise ConnectionError(
                    f"simulate.scheduler_address={scheduler_address!r}: no Dask scheduler answered ({err}); "
                    "start one there (`dask scheduler`, then `dask worker ADDRESS` on each machine) "
                    "or leave the address empty to start a cluster"
                ) from None
            planned = 0
        else:
            # the environment (thread variables) is read when the scheduler and each worker start
            with dask.config.set(scheduler_settings()), one_thread_per_worker():
                if cluster == "local":
                    # read when a worker dies: by default a LocalCluster retires a worker dead for 15 s for
                    # good, and a sample that keeps killing its workers could leave none; the nanny restarts it
                    stack.enter_context(dask.config.set({"distributed.deploy.lost-worker-timeout": "1000 days"}))
                    made = stack.enter_context(local_cluster(workers))
                    planned = workers
                else:
                    made = stack.enter_context(batch_cluster(cluster, cluster_cfg))
                    made.adapt(minimum_jobs=cluster_cfg.minimum_jobs, maximum_jobs=cluster_cfg.maximum_jobs)
                    planned = cluster_cfg.maximum_jobs * cluster_cfg.cores
            client = stack.enter_context(Client(made))
        client.register_plugin(OneThreadPerWorker())
        yield DaskRun(client, planned)


def local_cluster(workers: int) -> LocalCluster:
    """``workers`` single-threaded worker processes on this machine; quiet logs, HTTP server on a free port."""
    return LocalCluster(
        n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=":0", silence_logs=logging.ERROR,
    )


def batch_cluster(kind: str, cfg: ClusterConfig) -> Any:
    """A SLURM or PBS cluster of jobs of ``cfg.cores`` single-threaded worker processes (none submitted yet)."""
    check_cluster_settings(kind, cfg)
    from dask_jobqueue import PBSCluster, SLURMCluster

    environ = [f"export {v}=1" for v in THREAD_VARIABLES]  # read by the job's nannies: WORKER_ENVIRON there too
    environ.append(f'export DASK_DISTRIBUTED__NANNY__PRE_SPAWN_ENVIRON="{WORKER_ENVIRON!r}"')
    options: dict[str, Any] = {
        "cores": cfg.cores, "processes": cfg.cores, "memory": cfg.memory,
        "job_extra_directives": list(cfg.job_extra_directives),
        "job_script_prologue": [*environ, *cfg.job_script_prologue],
    }
    optional = {"queue": cfg.queue, "account": cfg.account, "walltime": cfg.walltime,
                "interface": cfg.interface, "local_directory": cfg.local_directory}
    options.update({name: value for name, value in optional.items() if value})
    return {"slurm": SLURMCluster, "pbs": PBSCluster}[kind](**options)
