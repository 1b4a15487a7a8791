"""The darcy app: 2-D steady Darcy flow through a two-phase medium, and its Fourier neural operator.

Simulator: a permeability field k (a thresholded Gaussian random field,
``permeability.py``) drawn from one seed per sample, and the pressure u of
``-div(k grad u) = f``, ``u = 0`` on the boundary, by a five-point finite-volume
scheme and a sparse solver (``solver.py``). Surrogate: an FNO from k to u
(``model.py``), trained on the relative L2 error. Baseline: the fastest of the
sparse direct and algebraic-multigrid solves, with their setup. The served input
(k) is exactly the simulator's input, so the trust gate can fall back to it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from converge.contract import App, ArraySpec, Baseline, BatchSource, Monitor, ReportSection, TensorSpec
from converge.data.sources import ArraySource, split_indices

from .config import DarcyConfig, DarcyEvalConfig, DarcyLearnConfig
from .model import FNO2d, relative_l2
from .permeability import sample_permeability
from .solver import solve_darcy

SEED_RANGE = 2**53  # a float64 holds every integer below this exactly: the seed travels as a parameter


def permeability_of(cfg: DarcyConfig, seed: float) -> np.ndarray:
    """The (n, n) float64 permeability field that ``seed`` draws under ``cfg``."""
    return sample_permeability(cfg.resolution, cfg.alpha, cfg.tau, cfg.k_high, cfg.k_low, int(seed))


def pressure_of(cfg: DarcyConfig, k: np.ndarray) -> np.ndarray:
    """The simulator's pressure (n, n) float64 for one permeability field, with ``cfg``'s solver."""
    return solve_darcy(k, cfg.forcing, cfg.solver, cfg.face_mean, cfg.amg_method, cfg.amg_tol)


def relative_spread(mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """``||std||_2 / ||mean||_2`` per field, (B, ...) -> (B,): the ensemble's spread on the scale of the
    relative L2 error it should predict."""
    mean = np.asarray(mean, dtype=np.float64).reshape(len(mean), -1)
    std = np.asarray(std, dtype=np.float64).reshape(len(std), -1)
    return np.linalg.norm(std, axis=1) / np.maximum(np.linalg.norm(mean, axis=1), 1e-30)


class DarcyApp(App):
    name = "darcy"
    config_cls = DarcyConfig
    evaluate_config_cls = DarcyEvalConfig
    learn_config_cls = DarcyLearnConfig
    monitor = Monitor("relative_l2", "min")
    packages = ("converge-darcy", "scipy", "pyamg")
    default_precision = "fp32"  # the Fourier layers compute in fp32 whatever the autocast (model.py)
    # what benchmarks/results/darcy.json was trained with: `converge train darcy` gets it without a config
    train_defaults = {"epochs": 50, "batch_size": 10, "lr": 2e-3, "checkpoint_every": 5}
    bench_batch_size = 16

    # -- simulate ---------------------------------------------------------------------
    def schema(self, cfg: DarcyConfig) -> dict[str, ArraySpec]:
        n = cfg.resolution  # float32: k holds 3 and 12 exactly, and u's 7 digits are far below any surrogate's error
        return {"permeability": ArraySpec((n, n), "float32"), "pressure": ArraySpec((n, n), "float32")}

    def sample_parameters(self, cfg: DarcyConfig, rng: np.random.Generator) -> dict[str, float]:
        return {"permeability_seed": float(rng.integers(SEED_RANGE))}

    def simulate(self, cfg: DarcyConfig, params: Mapping[str, float]) -> dict[str, np.ndarray]:
        k = permeability_of(cfg, params["permeability_seed"])
        return {"permeability": k.astype(np.float32), "pressure": pressure_of(cfg, k).astype(np.float32)}

    # -- train ------------------------------------------------------------------------
    def make_model(self, cfg: DarcyConfig) -> FNO2d:
        return FNO2d(cfg.width, cfg.modes, cfg.layers, cfg.padding)

    def make_datasets(self, cfg: DarcyConfig, arrays: Mapping[str, np.ndarray], seed: int,
                      val_fraction: float) -> tuple[BatchSource, BatchSource]:
        tensors = {"input": torch.from_numpy(np.ascontiguousarray(arrays["permeability"], dtype=np.float32)),
                   "target": torch.from_numpy(np.ascontiguousarray(arrays["pressure"], dtype=np.float32))}
        train_idx, val_idx = split_indices(len(tensors["input"]), val_fraction, seed)
        train = ArraySource({k: v[train_idx] for k, v in tensors.items()}, seed=seed)
        val = ArraySource({k: v[val_idx] for k, v in tensors.items()}, seed=seed, shuffle=False)
        return train, val

    def fit_to_data(self, model: torch.nn.Module, train_source: BatchSource) -> None:
        arrays = train_source.arrays  # type: ignore[attr-defined]
        model.set_normalisation(arrays["input"], arrays["target"])  # type: ignore[operator]

    def loss(self, cfg: DarcyConfig, output: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Mean over the batch of the relative L2 error of u (the FNO paper's loss)."""
        return relative_l2(output.float(), batch["target"].float()).mean()

    def metrics(self, outputs: torch.Tensor, batches: Mapping[str, torch.Tensor]) -> dict[str, float]:
        errors = relative_l2(outputs.double(), batches["target"].double()).numpy()
        return {"relative_l2": float(np.mean(errors)), "relative_l2_median": float(np.median(errors)),
                "relative_l2_p90": float(np.quantile(errors, 0.9))}

    # -- evaluate -----------------------------------------------------------------------
    def evaluate(self, run_dir: Path, data_dir: Path, out_dir: Path, **options: Any) -> dict:
        from .evaluate import evaluate_run

        return evaluate_run(self, Path(run_dir), Path(data_dir), Path(out_dir), **options)

    # -- serve --------------------------------------------------------------------------
    def serving_signature(self, cfg: DarcyConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        n = cfg.resolution  # raw permeability in; pressure on the same nodes out (0 on the boundary)
        return [TensorSpec("permeability", "FP32", (-1, n, n))], [TensorSpec("pressure", "FP32", (-1, n, n))]

    def serving_example(self, cfg: DarcyConfig, n: int, seed: int = 0) -> dict[str, np.ndarray]:
        """``n`` permeability fields drawn from the prior (seeds from ``default_rng(seed)``)."""
        rng = np.random.default_rng(seed)
        fields = [permeability_of(cfg, self.sample_parameters(cfg, rng)["permeability_seed"]) for _ in range(n)]
        return {"permeability": np.stack(fields).astype(np.float32)}  # (n, X, Y)

    def serve_predict(self, model: torch.nn.Module, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"pressure": model(inputs["permeability"]).float()}

    uncertainty_label = "relative pressure spread ||std|| / ||mean||"

    def uncertainty(self, cfg: DarcyConfig, inputs: Mapping[str, np.ndarray], mean: Mapping[str, np.ndarray],
                    std: Mapping[str, np.ndarray]) -> np.ndarray:
        """(B,) the members' relative spread of the pressure field (:func:`relative_spread`)."""
        return relative_spread(mean["pressure"], std["pressure"])

    def simulate_inputs(self, cfg: DarcyConfig, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The solver's pressure (B, n, n) float32 for exactly the served permeability fields (B, n, n)."""
        k = np.asarray(inputs["permeability"], dtype=np.float64)
        if k.ndim != 3 or k.shape[1:] != (cfg.resolution, cfg.resolution):
            raise ValueError(f"permeability of shape {k.shape}: the run takes (B, {cfg.resolution}, "
                             f"{cfg.resolution}) fields")
        return {"pressure": np.stack([pressure_of(cfg, field) for field in k]).astype(np.float32)}

    # -- learn --------------------------------------------------------------------------
    def learning_problem(self, cfg: DarcyConfig, options: DarcyLearnConfig | None = None) -> Any:
        from .learning import DarcyLearning

        return DarcyLearning(self, cfg, target_error=(options or DarcyLearnConfig()).target_error)

    # -- bench --------------------------------------------------------------------------
    def classical_baseline(self, cfg: DarcyConfig, device: torch.device, quick: bool = False) -> Baseline:
        """The fastest of sparse LU and CG with either AMG hierarchy on this machine, picked by timing all three
        on two prior fields (``quick``: the LU, unpicked). Each call assembles and solves every field,
        setup included; a solve has no batch (each k is a new matrix)."""
        from .timing import SOLVER_LABELS, fastest_solver, solver_variants

        fields = self.serving_example(cfg, 2, seed=1)["permeability"]
        choice, seconds = ("direct", {}) if quick else fastest_solver(cfg, fields)
        picked = solver_variants(cfg)[choice]

        def run(inputs: Mapping[str, np.ndarray]) -> np.ndarray:
            return np.stack([pressure_of(picked, field) for field in np.asarray(inputs["permeability"], np.float64)])

        return Baseline(f"{SOLVER_LABELS[choice]}, {cfg.resolution}x{cfg.resolution} nodes, assembly and setup "
                        "counted", run, 1, {"solver": choice, "resolution": cfg.resolution,
                                            "seconds_per_field_by_solver": seconds})

    def accuracy_summary(self, cfg: DarcyConfig, report: Mapping[str, Any]) -> dict[str, Any]:
        keys = ("relative_l2", "relative_l2_median", "relative_l2_p90", "n_test", "n_train_solves", "resolution")
        return {k: report[k] for k in keys if k in report}

    def synthetic_batch(self, cfg: DarcyConfig, batch_size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        n = cfg.resolution
        high = torch.rand(batch_size, n, n, generator=generator) < 0.5
        k = torch.where(high, cfg.k_high, cfg.k_low).float()  # (B, n, n): two-phase, as the prior's
        return {"input": k, "target": torch.rand(batch_size, n, n, generator=generator)}  # nonzero: a finite loss

    # -- demo, report, files ---------------------------------------------------------------
    def demo(self, out: Path, quick: bool = False, workers: int = 2) -> dict:
        from .demo import run_demo

        return run_demo(self, Path(out), quick=quick, workers=workers)

    def report_sections(self) -> list[ReportSection]:
        from .report import darcy_tables

        return [ReportSection("darcy", "darcy: Fourier neural operator against a sparse solver", ("darcy",),
                              "test relative L2 error of the pressure, and seconds per field of the FNO against the "
                              "fastest classical solve (setup counted), same CPU and threads (examples/darcy).",
                              darcy_tables)]

    def predict_file(self, run_dir: Path, path: Path, out: Path | None = None) -> Path:
        from .predict import predict_file

        return predict_file(self, Path(run_dir), Path(path), Path(out) if out else None)

    def summary(self, report: dict) -> dict:
        keys = ("resolution", "n_train_solves", "n_test", "relative_l2", "relative_l2_median", "relative_l2_p90",
                "fastest_classical", "seconds_per_field", "speedup")
        return {k: report[k] for k in keys if k in report}
