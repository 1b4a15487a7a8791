"""The local executor: a process pool on this machine, its workers' failures, and retries.

Each sample is one task on a :class:`~concurrent.futures.ProcessPoolExecutor`
whose workers run one thread each (the pool already uses every core). A task
ends in a :class:`~.sample.SampleOutcome`; a worker that dies breaks the whole
pool, which :func:`task_outcome` reports as :data:`WORKER_DIED` for every task it
was running. :class:`RetryQueue` decides which sample runs next and whether a
failed one runs again, charging a retry only to a sample known to have failed;
:func:`run_on_local_pool` drives it all.
"""
from __future__ import annotations

import multiprocessing
import os
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

from .sample import SampleJob, SampleOutcome, describe, simulate_sample

TASKS_PER_WORKER = 2  # in flight per worker: keeps workers busy, bounds memory and what a crash costs
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
DEATHS_BEFORE_GIVING_UP = 3  # samples in a row whose worker died: the workers cannot run at all
# The failure record of a sample whose worker died each time it ran, whatever the executor
WORKER_DIED = (
    "WorkerDied: a worker process died while running this sample "
    "(killed, out of memory, or a crash in native code)"
)


# -- scheduling -------------------------------------------------------------------------
class RetryQueue:
    """Which sample runs next, and whether a failed one gets another try.

    New samples come from ``pending``; failed ones run again, before new ones,
    while they have retries left. When a worker dies with several samples
    running, the culprit is unknown: those samples become uncharged *suspects*
    and run one at a time (``exclusive``), so that the next death names its
    sample, which is charged a retry. An innocent sample is never charged.
    """

    def __init__(self, pending: Iterator[int], retries: int) -> None:
        self.pending = pending
        self.retries = retries
        self.again: deque[int] = deque()
        self.suspects: deque[int] = deque()
        self.on_trial: int | None = None  # the suspect running alone
        self.attempts: dict[int, int] = {}

    @property
    def exclusive(self) -> bool:
        return bool(self.suspects) or self.on_trial is not None

    def next(self) -> int | None:
        if self.suspects:
            self.on_trial = self.suspects.popleft()
            return self.on_trial
        return self.again.popleft() if self.again else next(self.pending, None)

    def settle(self, outcome: SampleOutcome, culprit_known: bool) -> bool:
        """True if ``outcome`` is final; False if its sample was queued to run again."""
        if outcome.index == self.on_trial:
            self.on_trial = None
        if outcome.error is None or not outcome.retry:
            return True
        died = outcome.error == WORKER_DIED
        if died and not culprit_known:
            self.suspects.append(outcome.index)
            return False
        used = self.attempts.get(outcome.index, 0)
        if used >= self.retries:
            return True
        self.attempts[outcome.index] = used + 1
        (self.suspects if died else self.again).append(outcome.index)
        return False


def count_deaths(deaths: list[int], outcome: SampleOutcome) -> list[int]:
    """Samples given up on in a row because their worker died; too many means workers cannot run."""
    deaths = deaths + [outcome.index] if outcome.error == WORKER_DIED else []
    if len(deaths) >= DEATHS_BEFORE_GIVING_UP:
        raise RuntimeError(
            f"worker processes died on samples {deaths} in a row and finished none; if they die at start-up, "
            "check that the app's module imports in a fresh Python process (and that a script calling "
            "run_ensemble guards it with `if __name__ == '__main__':`)"
        )
    return deaths


# -- tasks ------------------------------------------------------------------------------
def worker_died(task: Future) -> bool:
    return isinstance(task.exception(), BrokenProcessPool)


def task_outcome(task: Future, index: int) -> SampleOutcome:
    """The outcome of the finished ``task`` that ran sample ``index``, whatever ended it."""
    error = task.exception()
    if error is None:
        return task.result()
    if isinstance(error, BrokenProcessPool):
        return SampleOutcome(index, None, None, WORKER_DIED, retry=True)
    if isinstance(error, KeyboardInterrupt):  # Ctrl-C reached the workers too: stop, keeping written shards
        raise KeyboardInterrupt
    return SampleOutcome(index, None, None, describe(error), retry=True)  # e.g. a result that cannot be pickled


# -- the pool ---------------------------------------------------------------------------
def init_worker() -> None:
    """One thread per worker: the workers already use every core."""
    for variable in THREAD_VARIABLES:
        os.environ[variable] = "1"
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)


def make_pool(workers: int, preload: Iterable[str]) -> ProcessPoolExecutor:
    """A pool that never forks a process holding threads (torch, OpenMP) directly.

    With forkserver, a server process imports the ``preload`` modules once (if
    it can: Python 3.11's server ignores sys.path additions); each worker is
    forked from it and starts fast, which keeps making the pool afresh after a
    worker died cheap.
    """
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(sorted(set(preload)))
    else:
        context = multiprocessing.get_context("spawn")
    return ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=init_worker)


def run_on_local_pool(
    job: SampleJob, indices: Iterator[int], record: Callable[[SampleOutcome], None], *, workers: int
) -> None:
    """Run the samples ``indices`` of ``job`` on ``workers`` processes, passing each final outcome to ``record``.

    A worker that dies breaks the pool: it is made afresh and the samples it was
    running run again (:class:`RetryQueue` finds and charges the culprit).
    """
    queue = RetryQueue(indices, job.retries)
    in_flight: dict[Future, int] = {}
    unsent: list[int] = []  # taken from the queue when the pool was found broken
    # torch (through the contract) is the slow import of nearly every app; no effect once the server runs
    preload = (simulate_sample.__module__, "converge.contract", job.app_cls.__module__)
    with one_thread_per_worker():
        pool = make_pool(workers, preload)
        try:
            while True:
                limit = 1 if queue.exclusive else TASKS_PER_WORKER * workers
                while len(in_flight) < limit and (index := unsent.pop() if unsent else queue.next()) is not None:
                    try:
                        in_flight[pool.submit(simulate_sample, *job.task_args(index))] = index
                    except BrokenProcessPool:  # a worker died since the last wait: its tasks tell below
                        unsent.append(index)
                        break
                if not in_flight:
                    if not unsent:
                        return
                    pool.shutdown(wait=True)  # it broke with nothing running: no sample to charge
                    pool = make_pool(workers, preload)
                    continue
                done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
                culprit_known = True
                if any(worker_died(task) for task in done):
                    wait(in_flight)  # a dead worker fails every unfinished task of the pool
                    done = set(in_flight)
                    culprit_known = sum(worker_died(task) for task in done) == 1
                    pool.shutdown(wait=True)
                    pool = make_pool(workers, preload)
                for task in sorted(done, key=in_flight.__getitem__):  # by index: a reproducible order
                    outcome = task_outcome(task, in_flight.pop(task))
                    if queue.settle(outcome, culprit_known):
                        record(outcome)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


@contextmanager
def one_thread_per_worker() -> Iterator[None]:
    """Workers inherit the environment, and numpy's BLAS reads it when loaded: 1 thread meanwhile."""
    saved = {variable: os.environ.get(variable) for variable in THREAD_VARIABLES}
    os.environ.update({variable: "1" for variable in THREAD_VARIABLES})
    try:
        yield
    finally:
        for variable, value in saved.items():
            if value is None:
                os.environ.pop(variable, None)
            else:
                os.environ[variable] = value
