"""Active learning: spend simulator calls where the ensemble disagrees (query by committee).

Seung, Opper and Sompolinsky, "Query by committee", COLT 1992; for network
potentials, Smith et al., "Less is more: sampling chemical space with active
learning", J. Chem. Phys. 148, 241733 (2018). Round 0 labels ``initial``
candidates drawn from the app's prior and trains an ensemble. Each of the
``rounds`` rounds then draws a pool of ``pool_size`` cheap candidates (no
simulator call), scores them by the previous ensemble's disagreement, labels
the ``budget / rounds`` best (``strategy="qbc"``) or as many random ones from the
same pool (``"random"``: the baseline), and trains a fresh ensemble on all data.
Both strategies see the same initial set, pools and test set for a given ``seed``.

Batch diversity (``diversity > 0``): a round that labels the top-k by disagreement
alone may spend several calls on near-duplicates of one disputed region. Taking
candidates in order of disagreement, one is skipped while it lies closer than
``d_min = diversity * median pairwise distance of the pool`` to one already
chosen, in the problem's descriptor space (chem: interatomic distances); if too
few remain, the skipped ones fill the batch in order of disagreement. This is the
greedy form of the diversity step of batch-mode active learning (Brinker, "Incorporating
diversity in active learning with support vector machines", ICML 2003).

What is a candidate, how it is labelled and scored is the app's part, a
:class:`LearningProblem` that ``App.learning_problem`` returns.

Layout of ``OUT`` (every file atomic; a rerun continues after the last finished
round, and inside a round reuses its selection, labelled shards and members)::

    OUT/learning.json               settings; a rerun with others is refused
    OUT/test/                       held-out set (shard store), unless test_dir is given
    OUT/round-{r}/selection.json    pool parameters, disagreement, chosen indices (r >= 1)
    OUT/round-{r}/data/             the samples labelled in round r (shard store)
    OUT/round-{r}/ensemble/         members, ensemble.json, calibration.json/png, the app's extras
    OUT/round-{r}/metrics.json      written last: the round is finished
    OUT/learning_curve.json/png     test error against simulator calls, one entry per round
"""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Protocol, Sequence

import numpy as np

from ..contract import App
from ..config import ConfigError, to_dict
from ..data.atomic import atomic_write_bytes, json_bytes, json_round_trip
from ..data.sources import stream_seed
from ..data.store import ShardStore, package_versions, schema_to_json
from ..simulate.runner import assemble_shard
from ..simulate.sample import SampleOutcome, check_arrays, describe
from ..train.loop import TrainConfig
from .calibration import calibrate, write_calibration
from .curves import calls_to_reach, plot_learning_curves, write_learning_curve
from .ensemble import EnsembleModel, EnsemblePrediction, load_ensemble, train_ensemble

STRATEGIES = ("qbc", "random")
STREAM_INITIAL, STREAM_POOL, STREAM_RANDOM, STREAM_TEST = 1, 2, 3, 4  # independent seed streams
LABEL_SHARD_SIZE = 8  # labelled samples per shard: an interrupted round loses at most these


class HeldOut(NamedTuple):
    """An ensemble on the labelled test set: metrics, and per-sample spread and error for calibration."""

    metrics: dict[str, Any]
    spread: np.ndarray  # (N,)
    error: np.ndarray  # (N,) prediction - truth, units of spread
    quantity: str
    units: str


class LearningProblem(Protocol):
    """The app's part of active learning, as ``App.learning_problem`` returns it."""

    app: App
    app_cfg: Any  # the config models train with and stores record
    target_error: float  # calibration target, units of HeldOut.error
    curve_metrics: tuple[str, ...]  # HeldOut.metrics keys plotted against simulator calls

    def draw(self, seed: int, n: int) -> list[dict[str, float]]:
        """``n`` candidates' parameters from the prior, deterministic in ``seed``; no simulator call.

        A problem may instead define ``draw_round(learn, r) -> list[params]`` (round 0: the initial set),
        which :func:`draw_round` then takes: a pool labelled beforehand hands out disjoint slices so."""

    def draw_test(self, seed: int, n: int) -> list[dict[str, float]]:
        """The held-out set's ``n`` parameters: the range the surrogate must answer for (may differ from
        what the cheap candidate sampler of :meth:`draw` yields)."""

    def inputs(self, params: Sequence[Mapping[str, float]]) -> dict[str, np.ndarray]:
        """Model inputs (``serve_predict`` names, batch axis first) of candidates, without the simulator."""

    def label(self, params: Mapping[str, float]) -> dict[str, np.ndarray]:
        """One simulator call: the app's schema arrays for one candidate."""

    def disagreement(self, prediction: EnsemblePrediction, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        """(N,) the ensemble's disagreement per candidate; larger = more worth labelling."""

    def descriptors(self, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        """(N, D) candidates as points whose Euclidean distance says how alike they are; used only by
        batch diversity (``diversity > 0``)."""

    def held_out(self, ensemble: EnsembleModel, arrays: Mapping[str, np.ndarray],
                 params: Mapping[str, np.ndarray]) -> HeldOut:
        """Errors and spreads of the ensemble on labelled held-out ``arrays``."""

    def after_training(self, ensemble_dir: Path, arrays: Mapping[str, np.ndarray]) -> None:
        """Store the app's extras with a trained ensemble (chem: the OOD envelope)."""


@dataclass(frozen=True)
class LearningConfig:
    """Settings of ``converge learn``: simulator calls are ``initial + budget`` (plus ``n_test`` once)."""

    initial: int = 16
    budget: int = 64
    rounds: int = 4
    pool_size: int = 512
    strategy: str = "qbc"
    seed: int = 0
    members: int = 4
    n_test: int = 40
    diversity: float = 0.0  # qbc: skip candidates closer than diversity * median pool distance (0: plain top-k)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"learn.strategy={self.strategy!r}: choose one of {', '.join(STRATEGIES)}")
        if not 0 <= self.diversity < 1:
            raise ConfigError(f"learn.diversity={self.diversity}: give a fraction of the pool's median distance "
                              "in [0, 1), e.g. 0.3 (0 turns batch diversity off)")
        for key, least in (("initial", 2), ("rounds", 1), ("members", 2), ("n_test", 1), ("seed", 0)):
            if getattr(self, key) < least:
                raise ConfigError(f"learn.{key}={getattr(self, key)}: must be >= {least}")
        if self.budget < self.rounds:
            raise ConfigError(f"learn.budget={self.budget} < learn.rounds={self.rounds}: every round labels at "
                              "least one candidate; raise the budget or lower the rounds")
        if self.pool_size < max(self.round_sizes()):
            raise ConfigError(f"learn.pool_size={self.pool_size}: smaller than the {max(self.round_sizes())} "
                              "candidates a round labels; use a pool several times larger")

    def round_sizes(self) -> list[int]:
        """Candidates labelled in rounds 1..R: ``budget`` split evenly, the remainder to the first rounds."""
        base, extra = divmod(self.budget, self.rounds)
        return [base + (1 if r < extra else 0) for r in range(self.rounds)]


def select_candidates(scores: np.ndarray, n: int, strategy: str, rng: np.random.Generator,
                      descriptors: np.ndarray | None = None, min_distance: float = 0.0) -> np.ndarray:
    """Indices of the ``n`` candidates to label: the highest ``scores`` first (``"qbc"``; NaN or inf,
    a model that broke down, counts as highest; ties keep pool order), or ``n`` uniformly at random.

    With ``descriptors`` (N, D) and ``min_distance > 0``, qbc skips a candidate closer than
    ``min_distance`` to one already chosen (:func:`diverse_top`)."""
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    if not 0 < n <= scores.size:
        raise ValueError(f"cannot select {n} of {scores.size} candidates")
    if strategy == "qbc":
        key = np.where(np.isfinite(scores), scores, np.inf)
        order = np.argsort(-key, kind="stable")
        if descriptors is None or min_distance <= 0:
            return order[:n]
        return diverse_top(order, np.asarray(descriptors, dtype=np.float64), n, min_distance)
    if strategy == "random":
        return np.sort(rng.choice(scores.size, size=n, replace=False))
    raise ValueError(f"strategy={strategy!r}: choose one of {', '.join(STRATEGIES)}")


def diverse_top(order: np.ndarray, descriptors: np.ndarray, n: int, min_distance: float) -> np.ndarray:
    """The first ``n`` of ``order`` (best first) that lie at least ``min_distance`` from every earlier
    pick in ``descriptors`` (N, D); the skipped ones fill up the batch, best first, if too few remain."""
    if len(descriptors) != len(order):
        raise ValueError(f"{len(descriptors)} descriptors for {len(order)} candidates")
    picked: list[int] = []
    skipped: list[int] = []
    for i in order:
        if len(picked) == n:
            break
        near = picked and np.min(np.linalg.norm(descriptors[picked] - descriptors[i], axis=1)) < min_distance
        (skipped if near else picked).append(int(i))
    return np.asarray(picked + skipped[: n - len(picked)], dtype=np.int64)


def median_distance(descriptors: np.ndarray, max_points: int = 1024) -> float:
    """Median Euclidean distance between pairs of (the first ``max_points``) rows of ``descriptors`` (N, D)."""
    from scipy.spatial.distance import pdist

    return float(np.median(pdist(np.asarray(descriptors, dtype=np.float64)[:max_points])))


def default_problem(app: App, app_cfg: Any, options: Any = None) -> LearningProblem:
    """The app's :class:`LearningProblem` (``App.learning_problem``), with its ``[learn]`` options."""
    return app.learning_problem(app_cfg, options)


# -- labelling ----------------------------------------------------------------------
def label_into_store(problem: LearningProblem, params: Sequence[Mapping[str, float]], root: Path, seed: int,
                     note: Mapping[str, Any]) -> ShardStore:
    """Simulate each candidate into the shard store ``root``; a failing call is recorded, not retried.

    Complete shards are kept, so an interrupted labelling redoes only its last shard.
    """
    app, cfg = problem.app, problem.app_cfg
    schema = schema_to_json(app.schema(cfg))
    header = {"app": app.name, "app_config": to_dict(cfg), "seed": int(seed), "n_samples": len(params),
              "shard_size": LABEL_SHARD_SIZE, "schema": schema, "simulate": json_round_trip(dict(note)),
              "versions": package_versions(getattr(app, "packages", ()))}
    store = ShardStore.create_or_open(root, header)
    for shard_id in range(store.n_shards):
        if store.is_complete(shard_id):
            continue
        outcomes = {}
        for i in store.shard_range(shard_id):
            p = {k: float(v) for k, v in params[i].items()}
            try:
                outcomes[i] = SampleOutcome(i, p, check_arrays(problem.label(p), schema))
            except Exception as err:  # a failed simulation is data: recorded with its parameters
                outcomes[i] = SampleOutcome(i, p, None, describe(err))
        store.write_shard(shard_id, *assemble_shard(outcomes, schema))
    return store


def _load_rounds(out_dir: Path, last: int, schema: Sequence[str]) -> tuple[dict[str, np.ndarray], int]:
    """All data labelled in rounds 0..last, and the simulator calls they took (failures included)."""
    stores = [ShardStore.open(round_dir(out_dir, r) / "data") for r in range(last + 1)]
    parts = [s.load(list(schema)) for s in stores]
    arrays = {k: np.concatenate([p[k] for p in parts]) for k in schema}
    return arrays, sum(s.n_samples for s in stores)


def round_dir(out_dir: Path, r: int) -> Path:
    return Path(out_dir) / f"round-{r}"


# -- the loop -----------------------------------------------------------------------
def run_active_learning(
    app: App,
    app_cfg: Any,
    out_dir: str | Path,
    initial: int = 16,
    budget: int = 64,
    rounds: int = 4,
    pool_size: int = 512,
    strategy: str = "qbc",
    seed: int = 0,
    members: int = 4,
    n_test: int = 40,
    diversity: float = 0.0,
    train_cfg: TrainConfig | None = None,
    problem: LearningProblem | None = None,
    test_dir: str | Path | None = None,
    progress: bool = False,
    stop_after: int | None = None,
) -> list[dict[str, Any]]:
    """Run (or continue) active learning into ``out_dir``; returns the metrics of every finished round.

    ``test_dir`` shares one held-out store between runs (e.g. the two strategies).
    ``stop_after`` returns after finishing that many rounds in this call, as a kill would.
    """
    learn = LearningConfig(initial, budget, rounds, pool_size, strategy, seed, members, n_test, diversity)
    train_cfg = train_cfg or TrainConfig()
    problem = problem or default_problem(app, app_cfg)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_settings(out_dir, app, problem, learn, train_cfg)
    test_root = Path(test_dir) if test_dir else out_dir / "test"
    test_params = problem.draw_test(stream_seed(seed, STREAM_TEST), n_test)
    test_store = label_into_store(problem, test_params, test_root, stream_seed(seed, STREAM_TEST),
                                  {"purpose": "active-learning test set"})
    test = (test_store.load(list(problem.app.schema(problem.app_cfg))), test_store.params())
    history, finished_now = [], 0
    for r in range(rounds + 1):
        path = round_dir(out_dir, r) / "metrics.json"
        if not path.is_file():
            if stop_after is not None and finished_now >= stop_after:
                break
            _run_round(problem, learn, train_cfg, out_dir, r, test, progress)
            finished_now += 1
        history.append(json.loads(path.read_text()))
        write_learning_curve(out_dir, history, problem.curve_metrics, learn.strategy)
    return history


def _write_settings(out_dir: Path, app: App, problem: LearningProblem, learn: LearningConfig,
                    train_cfg: TrainConfig) -> None:
    settings = json_round_trip({"app": app.name, "app_config": to_dict(problem.app_cfg), "learn": to_dict(learn),
                                "train": to_dict(train_cfg), "problem": getattr(problem, "settings", {})})
    path = out_dir / "learning.json"
    if path.is_file():
        found = json.loads(path.read_text())
        differ = [k for k in settings if found.get(k) != settings[k]]
        if differ:
            raise ConfigError(f"{out_dir} holds active learning with other {', '.join(differ)} settings; "
                              "use another output directory, or delete it to start over")
    else:
        atomic_write_bytes(path, json_bytes(settings))


def _run_round(problem: LearningProblem, learn: LearningConfig, train_cfg: TrainConfig, out_dir: Path, r: int,
               test: tuple[Mapping[str, np.ndarray], Mapping[str, np.ndarray]], progress: bool) -> None:
    here = round_dir(out_dir, r)
    here.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if r == 0:
        chosen, scoring = draw_round(problem, learn, 0), {}
    else:
        chosen, scoring = _select(problem, learn, out_dir, r)
    t_select = time.perf_counter()
    store = label_into_store(problem, chosen, here / "data", stream_seed(learn.seed, STREAM_POOL, r),
                             {"purpose": "active learning", "round": r, "strategy": learn.strategy})
    t_label = time.perf_counter()
    schema = list(problem.app.schema(problem.app_cfg))
    arrays, calls = _load_rounds(out_dir, r, schema)
    ensemble_dir = here / "ensemble"
    train_ensemble(problem.app, problem.app_cfg, train_cfg, arrays, ensemble_dir, learn.members, progress=progress,
                   extra_config={"active_learning_round": r})
    ensemble = load_ensemble(problem.app, ensemble_dir)
    held = problem.held_out(ensemble, *test)
    report = calibrate(held.spread, held.error, problem.target_error)
    write_calibration(ensemble_dir, report, held.spread, held.error, held.quantity, held.units)
    problem.after_training(ensemble_dir, arrays)
    t_train = time.perf_counter()
    metrics = {"round": r, "strategy": learn.strategy, "simulator_calls": calls, "n_train": len(arrays[schema[0]]),
               "added": len(store), "failed": len(store.failures()), **held.metrics, **scoring,
               "calibration": {k: report[k] for k in ("spearman", "coverage", "threshold", "rmse_over_rms_spread")},
               "seconds": {"select": t_select - t0, "simulate": t_label - t_select,
                           "train_and_test": t_train - t_label}}
    atomic_write_bytes(here / "metrics.json", json_bytes(json_round_trip(metrics)))


def draw_round(problem: LearningProblem, learn: LearningConfig, r: int) -> list[dict[str, float]]:
    """Round ``r``'s candidates: the initial set (r = 0) or the round's pool, from the problem's ``draw_round``
    if it has one (a pool labelled beforehand hands out disjoint slices: :mod:`.pooled`), else from ``draw``
    with the round's own seed."""
    if hasattr(problem, "draw_round"):
        return problem.draw_round(learn, r)
    if r == 0:
        return problem.draw(stream_seed(learn.seed, STREAM_INITIAL), learn.initial)
    return problem.draw(stream_seed(learn.seed, STREAM_POOL, r), learn.pool_size)


def _select(problem: LearningProblem, learn: LearningConfig, out_dir: Path, r: int) -> tuple[list, dict]:
    """Round r's candidates: from ``selection.json`` if an earlier try chose them, else chosen now."""
    path = round_dir(out_dir, r) / "selection.json"
    if not path.is_file():
        pool = draw_round(problem, learn, r)
        inputs = problem.inputs(pool)
        ensemble = load_ensemble(problem.app, round_dir(out_dir, r - 1) / "ensemble")
        scores = np.asarray(problem.disagreement(ensemble.predict(inputs), inputs), dtype=np.float64)
        rng = np.random.default_rng(stream_seed(learn.seed, STREAM_RANDOM, r))
        descriptors, min_distance = None, 0.0
        if learn.strategy == "qbc" and learn.diversity > 0:
            descriptors = problem.descriptors(inputs)
            min_distance = learn.diversity * median_distance(descriptors)
        picked = select_candidates(scores, learn.round_sizes()[r - 1], learn.strategy, rng, descriptors,
                                   min_distance)
        atomic_write_bytes(path, json_bytes(json_round_trip({
            "strategy": learn.strategy, "pool": pool, "disagreement": scores.tolist(), "selected": picked.tolist(),
            "min_distance": min_distance})))
    selection = json.loads(path.read_text())
    scores, picked = np.asarray(selection["disagreement"]), selection["selected"]
    scoring = {"pool_mean_disagreement": float(np.mean(scores)),
               "selected_mean_disagreement": float(np.mean(scores[picked]))}
    return [selection["pool"][i] for i in picked], scoring


def compare_strategies(app: App, app_cfg: Any, out_dir: str | Path, **options: Any) -> dict[str, Any]:
    """Active (qbc) and random learning with the same seeds, pools and test set: ``out_dir/active``,
    ``out_dir/random``, ``out_dir/test``; the joint curve in ``out_dir/learning_curve.png``.

    Round 0 (the initial set and its ensemble) is the same for both strategies, so random's is a
    copy of active's (:func:`share_initial_round`) rather than a second run of identical work.
    """
    out_dir = Path(out_dir)
    options.pop("strategy", None)
    problem = options.pop("problem", None) or default_problem(app, app_cfg)
    curves = {}
    for label, strategy in (("active", "qbc"), ("random", "random")):
        if label == "random":
            share_initial_round(out_dir / "active", out_dir / "random", strategy)
        curves[label] = run_active_learning(app, app_cfg, out_dir / label, strategy=strategy, problem=problem,
                                            test_dir=out_dir / "test", **options)
    plot_learning_curves(curves, problem.curve_metrics, out_dir / "learning_curve.png")
    metric = problem.curve_metrics[0]
    final_random = curves["random"][-1][metric]
    return {**curves, "metric": metric, "calls_to_reach_random_final": calls_to_reach(
        [h["simulator_calls"] for h in curves["active"]], [h[metric] for h in curves["active"]], final_random)}


def share_initial_round(source: Path, target: Path, strategy: str) -> bool:
    """Copy the finished round 0 of ``source`` into ``target`` (run with ``strategy``) unless there is
    one; True if copied.

    Round 0 does not depend on the strategy (same seed: same initial set, same member seeds),
    so the copy is what ``target`` would compute; its ``metrics.json`` names ``strategy``.
    """
    done, here = round_dir(source, 0) / "metrics.json", round_dir(target, 0)
    if not done.is_file() or (here / "metrics.json").is_file():
        return False
    staging = Path(target) / "round-0.partial"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.rmtree(here, ignore_errors=True)  # an unfinished round 0 of target's own
    shutil.copytree(round_dir(source, 0), staging)
    metrics = {**json.loads(done.read_text()), "strategy": strategy, "copied_from": str(Path(source).name)}
    atomic_write_bytes(staging / "metrics.json", json_bytes(json_round_trip(metrics)))
    staging.rename(here)
    return True
