"""The ensemble runner: an app's simulator over many parameter draws, into a shard store.

Sample ``i`` draws its parameters from ``np.random.default_rng([seed, i])``, so
the data depend on neither the number of workers nor the order in which shards
are computed. Each sample is one task on a local process pool; a shard is
written (atomically, see :mod:`converge.data.store`) as soon as its samples are
done, so an interrupted run loses at most the shards in progress and a rerun
computes only the shards still missing.

A sample that raises is tried ``retries`` more times, then recorded as a failure
(``"ExceptionType: message"`` with its parameters); its shard is written with the
other samples. A worker that dies (killed, out of memory, a crash in native code)
breaks the pool: the pool is made afresh and the samples it was running are run
again (see :class:`~converge.simulate.pool.RetryQueue` for how the one that killed
it is found and charged).
"""
from __future__ import annotations

import pickle
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, Task, TextColumn
from rich.progress import TimeRemainingColumn
from rich.text import Text

from ..config import ConfigError, to_dict
from ..data.store import CorruptShardError, ShardStore, package_versions, schema_to_json
from .pool import (
    RetryQueue, SampleOutcome, count_deaths, describe, make_pool, one_thread_per_worker, task_outcome, worker_died,
)
# Defined in .pool; still importable from here, where they were first.
from .pool import DEATHS_BEFORE_GIVING_UP, THREAD_VARIABLES, WORKER_DIED  # noqa: F401

TASKS_PER_WORKER = 2  # in flight per worker: keeps workers busy, bounds memory and what a crash costs


@dataclass(frozen=True)
class SimulateConfig:
    """Settings of ``converge simulate`` (the ``[simulate]`` table of a config file).

    ``samples`` parameter draws from ``seed``, stored in shards of ``shard_size``
    samples, computed by ``workers`` processes; a failing sample is tried
    ``retries`` more times. ``workers`` does not change the data.
    """

    samples: int = 1000
    seed: int = 0
    shard_size: int = 256
    workers: int = 2
    retries: int = 2

    def __post_init__(self) -> None:
        rules = (
            ("samples", 1, "the number of parameter draws to simulate"),
            ("seed", 0, "numpy seeds are non-negative integers"),
            ("shard_size", 1, "samples per shard file; a few hundred is typical"),
            ("workers", 1, "use at most the number of CPU cores you can spare"),
            ("retries", 0, "0 records a failing sample at once"),
        )
        for key, least, hint in rules:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"simulate.{key}={value!r}: must be an integer ({hint})")
            if value < least:
                raise ConfigError(f"simulate.{key}={value}: must be >= {least} ({hint})")


class EnsembleResult(NamedTuple):
    """The state of the dataset after a run (counts cover every written shard)."""

    n_ok: int
    n_failed: int
    failures: list[dict[str, Any]]  # {index, error, params}, by index
    shards_computed: int  # written by this run
    shards_skipped: int  # complete already, left untouched
    computed_ids: tuple[int, ...]
    skipped_ids: tuple[int, ...]
    missing_ids: tuple[int, ...]  # still to compute (the run was stopped by max_shards)

    @property
    def complete(self) -> bool:
        return not self.missing_ids


class ShardContent(NamedTuple):
    """One shard's outcomes, stacked for :meth:`ShardStore.write_shard`."""

    arrays: dict[str, np.ndarray]
    params: dict[str, np.ndarray]
    indices: np.ndarray
    failures: list[dict[str, Any]]


class SchemaMismatchError(ValueError):
    """``App.simulate`` returned arrays that do not match ``App.schema``."""


# -- one sample (runs in a worker) ------------------------------------------------------
def draw_parameters(app: Any, app_cfg: Any, seed: int, index: int) -> dict[str, float]:
    """Parameters of sample ``index``: ``app.sample_parameters`` on ``default_rng([seed, index])``."""
    raw = app.sample_parameters(app_cfg, np.random.default_rng([seed, index]))
    return {str(name): float(value) for name, value in raw.items()}


def check_arrays(arrays: Any, schema: Mapping[str, Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """``arrays`` as numpy arrays if they match ``schema`` (JSON form) exactly, else raise."""
    if not isinstance(arrays, Mapping):
        raise SchemaMismatchError(f"simulate() returned {type(arrays).__name__}; return a dict of arrays by name")
    if set(arrays) != set(schema):
        raise SchemaMismatchError(f"simulate() returned arrays {sorted(arrays)}, the schema names {sorted(schema)}")
    out = {}
    for name, spec in schema.items():
        value = np.asarray(arrays[name])
        shape, dtype = tuple(spec["shape"]), np.dtype(spec["dtype"])
        if value.shape != shape:
            raise SchemaMismatchError(f"array {name!r} has shape {value.shape}, the schema says {shape}")
        if value.dtype != dtype:
            raise SchemaMismatchError(
                f"array {name!r} has dtype {value.dtype}, the schema says {dtype}; "
                f"cast it in simulate() with .astype({dtype.name!r})"
            )
        out[name] = value
    return out


_WORKER_APPS: dict[type, Any] = {}  # one app instance per class and worker process


def simulate_sample(
    app_cls: type, app_cfg: Any, schema: Mapping[str, Mapping[str, Any]], seed: int, index: int
) -> SampleOutcome:
    """Draw the parameters of sample ``index``, simulate it, check its arrays."""
    params = None
    try:
        app = _WORKER_APPS.get(app_cls)
        if app is None:
            app = _WORKER_APPS[app_cls] = app_cls()
        params = draw_parameters(app, app_cfg, seed, index)
        arrays = check_arrays(app.simulate(app_cfg, params), schema)
    except SchemaMismatchError as err:  # the same every time: not worth a retry
        return SampleOutcome(index, params, None, describe(err), retry=False)
    except Exception as err:
        return SampleOutcome(index, params, None, describe(err), retry=True)
    return SampleOutcome(index, params, arrays)


def assemble_shard(outcomes: Mapping[int, SampleOutcome], schema: Mapping[str, Mapping[str, Any]]) -> ShardContent:
    """Stack the successful samples in index order and list the failed ones.

    A parameter that some samples lack is NaN for them.
    """
    ok = sorted(i for i, o in outcomes.items() if o.error is None)
    arrays = {
        name: np.stack([outcomes[i].arrays[name] for i in ok]) if ok
        else np.empty((0, *spec["shape"]), dtype=spec["dtype"])
        for name, spec in schema.items()
    }
    names = sorted({name for i in ok for name in outcomes[i].params})
    params = {name: np.array([outcomes[i].params.get(name, np.nan) for i in ok], dtype=np.float64) for name in names}
    failures = [
        {"index": i, "error": o.error, "params": o.params or {}}
        for i, o in sorted(outcomes.items()) if o.error is not None
    ]
    return ShardContent(arrays, params, np.array(ok, dtype=np.int64), failures)


# -- the run ----------------------------------------------------------------------------
def dataset_header(app: Any, app_cfg: Any, sim_cfg: SimulateConfig, schema: Mapping[str, Any]) -> dict[str, Any]:
    """What the store records about how its data were made (not ``workers``: it changes nothing)."""
    return {
        "app": app.name,
        "app_config": to_dict(app_cfg),
        "simulate": {k: v for k, v in to_dict(sim_cfg).items() if k != "workers"},
        "seed": sim_cfg.seed,
        "n_samples": sim_cfg.samples,
        "shard_size": sim_cfg.shard_size,
        "schema": schema_to_json(schema),
        "versions": package_versions(getattr(app, "packages", ())),
    }


def plan_shards(store: ShardStore, repair: bool) -> tuple[list[int], list[int]]:
    """(shards to compute, complete shards to skip); damaged shards need ``repair``."""
    never_written = set(store.missing_shards())
    todo, skipped, damaged = [], [], []
    for shard_id in range(store.n_shards):
        problem = store.shard_problem(shard_id)
        if problem is None:
            skipped.append(shard_id)
        elif shard_id in never_written or repair:
            todo.append(shard_id)
        else:
            damaged.append(problem)
    if damaged:
        raise CorruptShardError(
            f"{len(damaged)} written shard(s) of {store.root} are damaged:\n  " + "\n  ".join(damaged)
            + "\nrerun with --repair (run_ensemble(..., repair=True)) to recreate only those"
        )
    return todo, skipped


def run_ensemble(
    app: Any,
    app_cfg: Any,
    sim_cfg: SimulateConfig,
    out_dir: str | Path,
    progress: bool = True,
    repair: bool = False,
    max_shards: int | None = None,
) -> EnsembleResult:
    """Simulate ``sim_cfg.samples`` samples of ``app`` into the shard store ``out_dir``.

    Complete shards are skipped, so rerunning after an interruption finishes the
    job; ``repair=True`` also recreates written shards whose file is missing or
    corrupt (without it they raise :class:`CorruptShardError`). ``max_shards``
    computes at most that many shards, then returns (as an interruption would).
    Workers re-create the app as ``type(app)()``, so its class must be importable.
    """
    if not isinstance(sim_cfg, SimulateConfig):
        raise TypeError(f"sim_cfg must be a SimulateConfig, got {type(sim_cfg).__name__}")
    if max_shards is not None and max_shards < 0:
        raise ValueError(f"max_shards={max_shards}: must be >= 0 (or None for all)")
    _check_importable(type(app))
    schema = app.schema(app_cfg)
    store = ShardStore.create_or_open(out_dir, dataset_header(app, app_cfg, sim_cfg, schema))
    todo, skipped = plan_shards(store, repair)
    todo = todo if max_shards is None else todo[:max_shards]
    if todo:
        with _progress_bar(progress) as bar:
            task = bar.add_task("simulating", total=sum(len(store.shard_range(k)) for k in todo))
            _compute_shards(app, app_cfg, sim_cfg, store, todo, lambda: bar.advance(task))
    failures = store.failures()
    return EnsembleResult(
        n_ok=len(store), n_failed=len(failures), failures=failures, shards_computed=len(todo),
        shards_skipped=len(skipped), computed_ids=tuple(todo), skipped_ids=tuple(skipped),
        missing_ids=tuple(store.missing_shards()),
    )


def _compute_shards(
    app: Any, app_cfg: Any, sim_cfg: SimulateConfig, store: ShardStore, shard_ids: list[int],
    advance: Callable[[], None],
) -> None:
    """Run the samples of ``shard_ids`` on a pool, writing each shard when it is done."""
    queue = RetryQueue((i for k in shard_ids for i in store.shard_range(k)), sim_cfg.retries)
    by_shard: dict[int, dict[int, SampleOutcome]] = {}
    in_flight: dict[Future, int] = {}
    deaths: list[int] = []
    # torch (through apps.base) is the slow import of nearly every app; no effect once the server runs
    preload = (__name__, "converge.apps.base", type(app).__module__)
    with one_thread_per_worker():
        pool = make_pool(sim_cfg.workers, preload)
        try:
            while True:
                limit = 1 if queue.exclusive else TASKS_PER_WORKER * sim_cfg.workers
                while len(in_flight) < limit and (index := queue.next()) is not None:
                    task = pool.submit(simulate_sample, type(app), app_cfg, store.schema, sim_cfg.seed, index)
                    in_flight[task] = index
                if not in_flight:
                    return
                done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
                culprit_known = True
                if any(worker_died(task) for task in done):
                    wait(in_flight)  # a dead worker fails every unfinished task of the pool
                    done = set(in_flight)
                    culprit_known = sum(worker_died(task) for task in done) == 1
                    pool.shutdown(wait=True)
                    pool = make_pool(sim_cfg.workers, preload)
                for task in sorted(done, key=in_flight.__getitem__):  # by index: a reproducible order
                    outcome = task_outcome(task, in_flight.pop(task))
                    if not queue.settle(outcome, culprit_known):
                        continue
                    deaths = count_deaths(deaths, outcome)
                    if outcome.error is not None and outcome.params is None:
                        params = _parameters_or_none(app, app_cfg, sim_cfg.seed, outcome.index)
                        outcome = outcome._replace(params=params)
                    shard_id = outcome.index // store.shard_size
                    by_shard.setdefault(shard_id, {})[outcome.index] = outcome
                    advance()
                    if len(by_shard[shard_id]) == len(store.shard_range(shard_id)):
                        store.write_shard(shard_id, *assemble_shard(by_shard.pop(shard_id), store.schema))
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


def _parameters_or_none(app: Any, app_cfg: Any, seed: int, index: int) -> dict[str, float] | None:
    """Parameters for the failure record of a sample whose worker died."""
    try:
        return draw_parameters(app, app_cfg, seed, index)
    except Exception:
        return None


def _check_importable(app_cls: type) -> None:
    try:
        same = pickle.loads(pickle.dumps(app_cls)) is app_cls
    except Exception:
        same = False
    if not same:
        raise TypeError(
            f"app class {app_cls.__qualname__} cannot be sent to worker processes; "
            "define it at module level of an importable module"
        )


class SampleRateColumn(ProgressColumn):
    """Samples per second."""

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text(f"{speed:.1f} samples/s" if speed else "- samples/s", style="progress.data.speed")


def _progress_bar(enabled: bool) -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), SampleRateColumn(),
        TimeRemainingColumn(), console=Console(stderr=True), disable=not enabled,
    )
