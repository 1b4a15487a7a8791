"""One sample of an ensemble: draw its parameters, simulate it, check its arrays.

This is what runs in a worker, whatever the executor (local pool or Dask).
Sample ``i`` draws its parameters from ``np.random.default_rng([seed, i])``, so
its data depend on neither the worker nor the order in which samples run.
"""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import numpy as np


class SampleOutcome(NamedTuple):
    """What one task gives back: arrays, or an error and whether to try again."""

    index: int
    params: dict[str, float] | None
    arrays: dict[str, np.ndarray] | None
    error: str | None = None
    retry: bool = False


class SampleJob(NamedTuple):
    """What every sample of a run needs, besides its index; ``retries`` is for the executor."""

    app_cls: type
    app_cfg: Any
    schema: dict[str, dict[str, Any]]  # JSON form, as the store holds it
    seed: int
    retries: int

    def task_args(self, index: int) -> tuple[type, Any, dict[str, dict[str, Any]], int, int]:
        """The arguments of :func:`simulate_sample` for sample ``index``."""
        return (self.app_cls, self.app_cfg, self.schema, self.seed, index)


class SchemaMismatchError(ValueError):
    """``App.simulate`` returned arrays that do not match ``App.schema``."""


def describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def draw_parameters(app: Any, app_cfg: Any, seed: int, index: int) -> dict[str, float]:
    """Parameters of sample ``index``: ``app.sample_parameters`` on ``default_rng([seed, index])``."""
    raw = app.sample_parameters(app_cfg, np.random.default_rng([seed, index]))
    return {str(name): float(value) for name, value in raw.items()}


def parameters_or_none(app: Any, app_cfg: Any, seed: int, index: int) -> dict[str, float] | None:
    """Parameters for the failure record of a sample whose worker died (drawn again, by the caller)."""
    try:
        return draw_parameters(app, app_cfg, seed, index)
    except Exception:
        return None


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
