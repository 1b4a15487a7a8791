"""Active learning over a pool the simulator labelled beforehand (pool-based query by committee).

This is how ANI-1x's active learning was judged (Smith et al., J. Chem. Phys. 148, 241733 (2018)):
the potential trained on the data that query by committee chose is compared with one trained on as much
random data, and both are scored on another benchmark (COMP6, larger molecules than the training set).
The simulator labels the pool once. A strategy sees a row's label only when it chooses the row, and its
simulator calls are the rows it has chosen. Query by committee and random selection therefore pay the
same per call, and what they choose from is identical.

The initial set and each round's pool are disjoint slices of one seeded permutation of the rows: the
initial set comes first, then one slice of ``pool_size`` rows per round. Neither strategy is offered a
row twice, and both are offered the same rows in every round. The held-out set is a separate labelled
set (``test``), such as other molecules than the pool's.

Scoring, batch diversity, held-out metrics and the extras stored with an ensemble are the wrapped
problem's (the app's :class:`~converge.validate.active.LearningProblem`). So with chem, the committee's
energy spread per atom picks the rows.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ..config import ConfigError
from ..data.sources import stream_seed
from .active import STREAM_POOL, HeldOut, LearningConfig, LearningProblem
from .ensemble import EnsembleModel, EnsemblePrediction


class PooledProblem:
    """A :class:`~converge.validate.active.LearningProblem` whose candidates are rows of a labelled ``pool``
    (the app's schema arrays, batch axis first) and whose held-out set is ``test`` (the same arrays)."""

    def __init__(self, base: LearningProblem, pool: Mapping[str, np.ndarray], test: Mapping[str, np.ndarray],
                 curve_metrics: Sequence[str] | None = None, note: Mapping[str, Any] | None = None) -> None:
        self.base, self.app, self.app_cfg = base, base.app, base.app_cfg
        self.target_error = base.target_error
        self.curve_metrics = tuple(curve_metrics or base.curve_metrics)
        schema = self.app.schema(self.app_cfg)
        for name, arrays in (("pool", pool), ("test", test)):
            missing = [k for k in schema if k not in arrays]
            if missing:
                raise ConfigError(f"the labelled {name} lacks {', '.join(missing)} of the app's schema {list(schema)}")
            for key, spec in schema.items():
                found = np.asarray(arrays[key])
                if found.shape[1:] != tuple(spec.shape) or found.dtype != np.dtype(spec.dtype):
                    raise ConfigError(f"the labelled {name}'s {key} is {found.dtype} {found.shape[1:]} per row, the "
                                      f"app's schema says {spec.dtype} {tuple(spec.shape)}: pad or cast the rows "
                                      "to it, or configure the app for them (chem: app.max_atoms)")
        self.pool = {k: np.asarray(pool[k]) for k in schema}
        self.test = {k: np.asarray(test[k]) for k in schema}
        first = next(iter(schema))
        self.n_pool, self.n_test = len(self.pool[first]), len(self.test[first])
        self.settings = {"labelled_pool_rows": self.n_pool, "test_rows": self.n_test, **dict(note or {})}

    def draw_round(self, learn: LearningConfig, r: int) -> list[dict[str, float]]:
        """Round ``r``'s rows: the first ``initial`` of the permutation (r = 0), then ``pool_size`` per round."""
        needed = learn.initial + learn.rounds * learn.pool_size
        if needed > self.n_pool:
            raise ConfigError(f"initial + rounds x pool_size = {learn.initial} + {learn.rounds} x {learn.pool_size} "
                              f"= {needed} rows, but the labelled pool holds {self.n_pool}: lower the pool size "
                              "or the rounds, or label a larger pool")
        order = np.random.default_rng(stream_seed(learn.seed, STREAM_POOL)).permutation(self.n_pool)
        start, stop = (0, learn.initial) if r == 0 else (learn.initial + (r - 1) * learn.pool_size,
                                                         learn.initial + r * learn.pool_size)
        return [{"row": float(i)} for i in order[start:stop]]

    def draw(self, seed: int, n: int) -> list[dict[str, float]]:
        raise NotImplementedError("a labelled pool hands out disjoint slices by round: use draw_round, as "
                                  "run_active_learning does, so that no strategy is offered a row twice")

    def draw_test(self, seed: int, n: int) -> list[dict[str, float]]:
        """Every row of ``test``, in order (``n`` must be their number)."""
        if n != self.n_test:
            raise ConfigError(f"n_test={n}: the labelled test set has {self.n_test} rows; give n_test={self.n_test}")
        return [{"test_row": float(i)} for i in range(n)]

    def _rows(self, params: Sequence[Mapping[str, float]]) -> np.ndarray:
        return np.asarray([int(p["row"]) for p in params], dtype=np.int64)

    def inputs(self, params: Sequence[Mapping[str, float]]) -> dict[str, np.ndarray]:
        """The served model's inputs (``serving_signature``) of these pool rows, from the stored arrays."""
        rows = self._rows(params)
        return {spec.name: self.pool[spec.name][rows] for spec in self.app.serving_signature(self.app_cfg)[0]}

    def label(self, params: Mapping[str, float]) -> dict[str, np.ndarray]:
        """The stored label of one pool row (or, for the held-out set, one test row)."""
        if "test_row" in params:
            return {k: v[int(params["test_row"])] for k, v in self.test.items()}
        return {k: v[int(params["row"])] for k, v in self.pool.items()}

    def disagreement(self, prediction: EnsemblePrediction, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        return self.base.disagreement(prediction, inputs)

    def descriptors(self, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        return self.base.descriptors(inputs)

    def held_out(self, ensemble: EnsembleModel, arrays: Mapping[str, np.ndarray],
                 params: Mapping[str, np.ndarray]) -> HeldOut:
        return self.base.held_out(ensemble, arrays, params)

    def after_training(self, ensemble_dir: Path, arrays: Mapping[str, np.ndarray]) -> None:
        self.base.after_training(ensemble_dir, arrays)
