"""Timing the classical solvers and the FNO on the same fields, same process, same threads.

A classical solve of one field is everything it costs to answer from k:
assembling the matrix, its setup (the LU factorisation, or the AMG hierarchy:
every k is a new matrix, so neither can be reused across fields) and the
solve. Each solver is called once untimed (imports, caches), then once on each
of the given fields; its time is the mean per field. The FNO is timed as
``converge bench surrogate`` times surrogates (:func:`converge.bench.surrogate.time_per_sample`):
its ``serve_predict`` on raw k, normalisation included, one field per call and a batch per call.
Both sides take the best of ``repeats`` such measurements (as ``timeit`` does): on a
machine shared with other work the least disturbed one is the closest to the method's own cost.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from .config import DarcyConfig
from .solver import solve_darcy

SOLVER_LABELS = {"direct": "sparse LU (SuperLU, minimum degree on A^T+A)",
                 "amg_ruge_stuben": "pyamg Ruge-Stuben AMG + CG",
                 "amg_smoothed_aggregation": "pyamg smoothed-aggregation AMG + CG"}


def solver_variants(cfg: DarcyConfig) -> dict[str, DarcyConfig]:
    """The classical solvers timed, by name: ``cfg`` with each solver (AMG at ``cfg.amg_tol``)."""
    return {"direct": replace(cfg, solver="direct"),
            "amg_ruge_stuben": replace(cfg, solver="amg", amg_method="ruge_stuben"),
            "amg_smoothed_aggregation": replace(cfg, solver="amg", amg_method="smoothed_aggregation")}


def seconds_per_solve(cfg: DarcyConfig, fields: np.ndarray, repeats: int = 1) -> float:
    """Wall seconds to assemble and solve one of ``fields`` (N, n, n) with ``cfg``'s solver: the mean over the
    fields, best of ``repeats`` passes."""
    solve_darcy(fields[0], cfg.forcing, cfg.solver, cfg.face_mean, cfg.amg_method, cfg.amg_tol)  # untimed warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for k in fields:
            solve_darcy(k, cfg.forcing, cfg.solver, cfg.face_mean, cfg.amg_method, cfg.amg_tol)
        best = min(best, (time.perf_counter() - t0) / len(fields))
    return best


def time_classical(cfg: DarcyConfig, fields: np.ndarray, repeats: int = 1) -> dict[str, float]:
    """Seconds per field of every classical solver (:func:`solver_variants`) on the same ``fields``."""
    fields = np.asarray(fields, dtype=np.float64)
    return {name: seconds_per_solve(variant, fields, repeats) for name, variant in solver_variants(cfg).items()}


def fastest_solver(cfg: DarcyConfig, fields: np.ndarray) -> tuple[str, dict[str, float]]:
    """(name of the fastest classical solver on ``fields``, seconds per field of each)."""
    seconds = time_classical(cfg, fields)
    return min(seconds, key=seconds.__getitem__), seconds


def time_fno(app: Any, model: torch.nn.Module, fields: np.ndarray, batch_size: int,
             min_time_s: float, repeats: int = 1) -> dict[str, Any]:
    """Seconds per field of ``app.serve_predict`` on one field and on ``batch_size`` fields per call (CPU),
    each the best of ``repeats`` timings."""
    from converge.bench.surrogate import time_per_sample

    device = torch.device("cpu")
    k = torch.from_numpy(np.ascontiguousarray(fields, dtype=np.float32))
    batch = k[:batch_size] if len(k) >= batch_size else k.repeat(-(-batch_size // len(k)), 1, 1)[:batch_size]

    def predict(x: torch.Tensor) -> Any:
        with torch.inference_mode():
            return app.serve_predict(model, {"permeability": x})

    single = min(time_per_sample(lambda: predict(k[:1]), 1, device, min_time_s)["seconds_per_sample"]
                 for _ in range(repeats))
    batched = min(time_per_sample(lambda: predict(batch), batch_size, device, min_time_s)["seconds_per_sample"]
                  for _ in range(repeats))
    return {"single": single, "batched": batched, "batch": batch_size}


def speed_entry(classical: dict[str, float], fno: dict[str, Any]) -> dict[str, Any]:
    """Seconds per field of each method, the fastest classical one, and the FNO's speed-ups over it."""
    fastest = min(classical, key=classical.__getitem__)
    return {"seconds_per_field": {**classical, "fno_single": fno["single"], "fno_batched": fno["batched"]},
            "fno_batch": fno["batch"], "fastest_classical": fastest,
            "speedup": {"single": classical[fastest] / fno["single"], "batched": classical[fastest] / fno["batched"]}}
