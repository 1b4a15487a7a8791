"""The FNO against the sparse solver on a held-out test set: relative L2 error of u, and time per field.

``evaluation.json`` (strict JSON, written atomically) holds the error statistics
over the test fields, the classical solvers' and the FNO's seconds per field
(:mod:`converge_darcy.timing`, same process and threads) and the speed-ups over
the fastest classical solver; ``fields.png`` draws k / true u / predicted u /
error for the first few test fields, ``errors.png`` the distribution of the error.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from converge.bench.artifacts import pyplot, save_figure, write_json
from converge.config import from_dict, to_dict
from converge.data.store import ShardStore
from converge.train.loop import load_model

from .config import DarcyConfig, DarcyEvalConfig
from .model import relative_l2
from .timing import speed_entry, time_classical, time_fno


def predict_fields(app: Any, model: torch.nn.Module, k: np.ndarray, batch_size: int = 64) -> np.ndarray:
    """The FNO's pressure (N, n, n) float32 for raw permeability fields k (N, n, n), in batches."""
    parts = []
    with torch.inference_mode():
        for start in range(0, len(k), batch_size):
            chunk = torch.from_numpy(np.ascontiguousarray(k[start : start + batch_size], dtype=np.float32))
            parts.append(app.serve_predict(model, {"permeability": chunk})["pressure"].numpy())
    return np.concatenate(parts)


def error_statistics(predicted: np.ndarray, true: np.ndarray) -> dict[str, float]:
    """Mean, median, 90th percentile and maximum over fields of the relative L2 error of u."""
    errors = relative_l2(torch.from_numpy(np.asarray(predicted, np.float64)),
                         torch.from_numpy(np.asarray(true, np.float64))).numpy()
    return {"relative_l2": float(np.mean(errors)), "relative_l2_median": float(np.median(errors)),
            "relative_l2_p90": float(np.quantile(errors, 0.9)), "relative_l2_max": float(np.max(errors))}


def plot_fields(k: np.ndarray, true: np.ndarray, predicted: np.ndarray, path: Path) -> Path:
    """One row per field: permeability, solver's u, FNO's u (same colour scale) and their difference."""
    plt = pyplot()
    rows = len(k)
    fig, axes = plt.subplots(rows, 4, figsize=(13, 3.1 * rows), squeeze=False)
    for r in range(rows):
        err = predicted[r] - true[r]
        rel = np.linalg.norm(err) / np.linalg.norm(true[r])
        vmax = float(max(true[r].max(), predicted[r].max()))
        panels = ((k[r], "permeability k", "viridis", None), (true[r], "u, sparse solver", "magma", (0, vmax)),
                  (predicted[r], "u, FNO", "magma", (0, vmax)), (err, f"FNO - solver (rel. L2 {rel:.2%})", "RdBu_r",
                                                                  None))
        for ax, (field, title, cmap, limits) in zip(axes[r], panels):
            if cmap == "RdBu_r":
                bound = float(np.abs(field).max()) or 1.0
                limits = (-bound, bound)
            image = ax.imshow(field.T, origin="lower", extent=(0, 1, 0, 1), cmap=cmap,
                              vmin=None if limits is None else limits[0], vmax=None if limits is None else limits[1])
            fig.colorbar(image, ax=ax, fraction=0.046)
            ax.set_title(title, fontsize=9)
            ax.set_xticks([]), ax.set_yticks([])
    fig.tight_layout()
    return save_figure(fig, path)


def plot_errors(errors: np.ndarray, path: Path) -> Path:
    """Histogram of the per-field relative L2 errors, with their mean."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    ax.hist(100 * errors, bins=30, color="tab:blue", alpha=0.8)
    ax.axvline(100 * errors.mean(), color="k", ls="--", label=f"mean {errors.mean():.2%}")
    ax.set(xlabel="relative L2 error of u per test field [%]", ylabel="fields")
    ax.legend()
    fig.tight_layout()
    return save_figure(fig, path)


def evaluate_run(app: Any, run_dir: Path, data_dir: Path, out_dir: Path,
                 ev: DarcyEvalConfig | None = None) -> dict[str, Any]:
    """Evaluate the run's best model on the test store ``data_dir``; writes into ``out_dir``."""
    ev = ev or DarcyEvalConfig()
    model, config = load_model(app, run_dir)
    cfg = from_dict(DarcyConfig, config["app_config"], "app")
    store = ShardStore.open(data_dir)
    tested = store.manifest["app_config"]
    if tested.get("resolution") != cfg.resolution:
        raise ValueError(f"{data_dir} holds {tested.get('resolution')}-node fields, the run was trained on "
                         f"{cfg.resolution}; simulate the test set with app.resolution={cfg.resolution}")
    arrays = store.load(["permeability", "pressure"])
    k, true = arrays["permeability"], arrays["pressure"]
    if len(k) == 0:
        raise ValueError(f"{data_dir} holds no fields to evaluate on")
    predicted = predict_fields(app, model, k, ev.batch_size)
    stats = error_statistics(predicted, true)
    errors = relative_l2(torch.from_numpy(predicted.astype(np.float64)), torch.from_numpy(true.astype(np.float64)))
    timing_fields = k[: ev.timing_fields]
    speed = speed_entry(time_classical(cfg, timing_fields, ev.repeats),
                        time_fno(app, model, k, ev.batch_size, ev.min_time_s, ev.repeats))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_fields(k[: ev.plot_fields], true[: ev.plot_fields], predicted[: ev.plot_fields], out_dir / "fields.png")
    plot_errors(errors.numpy(), out_dir / "errors.png")
    report = {"app": app.name, "run": str(run_dir), "data": str(data_dir), "resolution": cfg.resolution,
              "n_test": int(len(k)), "n_train": config.get("n_train_samples"),
              "n_train_solves": (config.get("n_train_samples") or 0) + (config.get("n_val_samples") or 0),
              **stats, **speed, "threads": torch.get_num_threads(), "timing_fields": int(len(timing_fields)),
              "timing": f"solvers: assembly + setup + solve, mean over timing_fields distinct test fields after one "
                        f"untimed call; FNO: serve_predict on raw k, mean over calls filling min_time_s after one "
                        f"untimed call; each the best of {ev.repeats}; torch threads as shown, same process",
              "app_config": to_dict(cfg), "evaluate": to_dict(ev)}
    write_json(out_dir / "evaluation.json", report)
    return report
