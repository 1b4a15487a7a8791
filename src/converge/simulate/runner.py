"""The ensemble runner: an app's simulator over many parameter draws, into a shard store.

Sample ``i`` draws its parameters from ``np.random.default_rng([seed, i])``, so
the data depend on neither the number of workers, nor the executor, nor the
order in which shards are computed. Each sample is one task on an executor (a
local process pool, or Dask: see :mod:`converge.simulate.executors`); a shard is
written (atomically, see :mod:`converge.data.store`) as soon as its samples are
done, so an interrupted run loses at most the shards in progress and a rerun
computes only the shards still missing.

A sample that raises is tried ``retries`` more times, then recorded as a failure
(``"ExceptionType: message"`` with its parameters); its shard is written with the
other samples. A worker that dies (killed, out of memory, a crash in native code)
costs only the samples it was running, which run again; one that was running each
time its worker died is recorded as :data:`~converge.simulate.pool.WORKER_DIED`.
"""
from __future__ import annotations

import pickle
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
from .executors import CLUSTERS, EXECUTORS, ClusterConfig, check_cluster_settings, run_samples
from .pool import count_deaths
from .sample import SampleJob, SampleOutcome, parameters_or_none
# Defined in .pool and .sample; still importable from here, where they were first.
from .pool import DEATHS_BEFORE_GIVING_UP, THREAD_VARIABLES, WORKER_DIED, RetryQueue  # noqa: F401
from .sample import SchemaMismatchError, check_arrays, draw_parameters, simulate_sample  # noqa: F401

# How the samples are computed, not what they are: left out of the dataset's header
EXECUTION_KEYS = ("workers", "executor", "scheduler_address", "cluster")


@dataclass(frozen=True)
class SimulateConfig:
    """Settings of ``converge simulate`` (the ``[simulate]`` table of a config file).

    ``samples`` parameter draws from ``seed``, stored in shards of ``shard_size``
    samples, computed by ``workers`` processes; a failing sample is tried
    ``retries`` more times. ``executor`` runs the samples: ``"local"``, a process
    pool; ``"dask"``, Dask tasks on the scheduler at ``scheduler_address`` if set,
    else on a ``cluster`` it starts: ``"local"`` (``workers`` processes on this
    machine), ``"slurm"`` or ``"pbs"`` (batch jobs set by the ``[cluster]`` table,
    :class:`~converge.simulate.executors.ClusterConfig`). None of ``workers``,
    ``executor``, ``scheduler_address``, ``cluster`` changes the data.
    """

    samples: int = 1000
    seed: int = 0
    shard_size: int = 256
    workers: int = 2
    retries: int = 2
    executor: str = "local"
    scheduler_address: str = ""
    cluster: str = "local"

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
        self._check_executor()

    def _check_executor(self) -> None:
        for key, known in (("executor", EXECUTORS), ("cluster", CLUSTERS)):
            value = getattr(self, key)
            if value not in known:
                raise ConfigError(f"simulate.{key}={value!r}: choose one of {', '.join(map(repr, known))}")
        if not isinstance(self.scheduler_address, str) or any(c.isspace() for c in self.scheduler_address):
            raise ConfigError(
                f"simulate.scheduler_address={self.scheduler_address!r}: give the scheduler's address as text "
                "without spaces, e.g. \"tcp://10.0.0.5:8786\""
            )
        if self.executor == "local":
            for key, default in (("scheduler_address", ""), ("cluster", "local")):
                if getattr(self, key) != default:
                    raise ConfigError(
                        f"simulate.{key}={getattr(self, key)!r} needs simulate.executor=\"dask\" "
                        f"(it is {self.executor!r}); set executor = \"dask\" or remove {key}"
                    )
        if self.scheduler_address and self.cluster != "local":
            raise ConfigError(
                f"simulate.scheduler_address={self.scheduler_address!r} and simulate.cluster={self.cluster!r} "
                "both say where the workers are; keep the address to use a running scheduler, "
                "or remove it to start the cluster"
            )


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


# -- shards ------------------------------------------------------------------------------
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
    """What the store records about how its data were made (not :data:`EXECUTION_KEYS`: they change nothing)."""
    return {
        "app": app.name,
        "app_config": to_dict(app_cfg),
        "simulate": {k: v for k, v in to_dict(sim_cfg).items() if k not in EXECUTION_KEYS},
        "seed": sim_cfg.seed,
        "n_samples": sim_cfg.samples,
        "shard_size": sim_cfg.shard_size,
        "schema": schema_to_json(schema),
        "versions": package_versions(getattr(app, "packages", ())),
    }


def stored_config_if_same(root: Path, app: Any, app_cfg: Any, header: dict[str, Any]) -> dict[str, Any]:
    """``header`` with the stored dataset's ``app_config`` where that reads back as ``app_cfg``: a store made
    before a setting was added to the app's config (absent there, its default here) resumes, while one made
    with a different value is refused as before."""
    from ..config import from_dict

    try:
        stored = ShardStore.open(root).manifest["app_config"]
        same = stored != header["app_config"] and from_dict(type(app_cfg), stored, "app") == app_cfg
    except Exception:  # noqa: BLE001 - no store or an unreadable one: create_or_open says what is wrong
        return header
    return {**header, "app_config": stored} if same else header


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
    cluster_cfg: ClusterConfig | None = None,
) -> EnsembleResult:
    """Simulate ``sim_cfg.samples`` samples of ``app`` into the shard store ``out_dir``.

    Complete shards are skipped, so rerunning after an interruption finishes the
    job; ``repair=True`` also recreates written shards whose file is missing or
    corrupt (without it they raise :class:`CorruptShardError`). ``max_shards``
    computes at most that many shards, then returns (as an interruption would).
    ``cluster_cfg`` sets the batch jobs of ``sim_cfg.cluster = "slurm"|"pbs"``.
    Workers re-create the app as ``type(app)()``, so its class must be importable.
    """
    if not isinstance(sim_cfg, SimulateConfig):
        raise TypeError(f"sim_cfg must be a SimulateConfig, got {type(sim_cfg).__name__}")
    if max_shards is not None and max_shards < 0:
        raise ValueError(f"max_shards={max_shards}: must be >= 0 (or None for all)")
    cluster_cfg = cluster_cfg or ClusterConfig()
    if sim_cfg.executor == "dask" and not sim_cfg.scheduler_address:
        check_cluster_settings(sim_cfg.cluster, cluster_cfg)
    _check_importable(type(app))
    schema = app.schema(app_cfg)
    header = stored_config_if_same(Path(out_dir), app, app_cfg, dataset_header(app, app_cfg, sim_cfg, schema))
    store = ShardStore.create_or_open(out_dir, header)
    todo, skipped = plan_shards(store, repair)
    todo = todo if max_shards is None else todo[:max_shards]
    if todo:
        with _progress_bar(progress) as bar:
            task = bar.add_task("simulating", total=sum(len(store.shard_range(k)) for k in todo))
            writer = ShardWriter(app, app_cfg, sim_cfg.seed, store, lambda: bar.advance(task))
            job = SampleJob(type(app), app_cfg, store.schema, sim_cfg.seed, sim_cfg.retries)
            run_samples(
                job, (i for k in todo for i in store.shard_range(k)), writer.record, executor=sim_cfg.executor,
                workers=sim_cfg.workers, cluster=sim_cfg.cluster, scheduler_address=sim_cfg.scheduler_address,
                cluster_cfg=cluster_cfg,
            )
    failures = store.failures()
    return EnsembleResult(
        n_ok=len(store), n_failed=len(failures), failures=failures, shards_computed=len(todo),
        shards_skipped=len(skipped), computed_ids=tuple(todo), skipped_ids=tuple(skipped),
        missing_ids=tuple(store.missing_shards()),
    )


class ShardWriter:
    """Collects final outcomes by shard and writes each shard the moment its last sample is in.

    Executors hand outcomes to :meth:`record` in any order; a failure whose
    parameters are unknown (its worker died) gets them drawn again here.
    """

    def __init__(self, app: Any, app_cfg: Any, seed: int, store: ShardStore, advance: Callable[[], None]) -> None:
        self.app, self.app_cfg, self.seed = app, app_cfg, seed
        self.store = store
        self.advance = advance
        self.by_shard: dict[int, dict[int, SampleOutcome]] = {}
        self.deaths: list[int] = []

    def record(self, outcome: SampleOutcome) -> None:
        self.deaths = count_deaths(self.deaths, outcome)
        if outcome.error is not None and outcome.params is None:
            outcome = outcome._replace(params=parameters_or_none(self.app, self.app_cfg, self.seed, outcome.index))
        shard_id = outcome.index // self.store.shard_size
        outcomes = self.by_shard.setdefault(shard_id, {})
        outcomes[outcome.index] = outcome
        self.advance()
        if len(outcomes) == len(self.store.shard_range(shard_id)):
            self.store.write_shard(shard_id, *assemble_shard(self.by_shard.pop(shard_id), self.store.schema))


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
