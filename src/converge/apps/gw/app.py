"""The gw app: detect binary-black-hole mergers in whitened LIGO strain.

Simulator: IMRPhenomD waveforms (LALSuite) projected on a detector and whitened
by the Advanced LIGO design PSD; with ``app.detectors = ["H1", "L1"]`` (the MLGWSC-1
presets, ``GWConfig.mlgwsc1``) on each detector with its antenna pattern and arrival
delay. Surrogate: a 1D CNN, coherent over the detectors (``model.py``). Baseline:
matched filtering over a template bank. See ``pipeline.py`` for what is drawn fresh.
Searches over continuous data: ``converge search gw`` (``search.py``, ``mfsearch.py``,
``follow.py``), scored with the challenge's own code (``challenge.py``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
import torch.nn.functional as F

from ...contract import App, ArraySpec, BatchSource, Monitor, TensorSpec
from .config import GWConfig
from .model import DetectionCNN
from .pipeline import WindowSource
from .waveforms import sample_bbh_parameters, whitened_signal


def curriculum_snr_range(cfg: GWConfig, epoch: int, epochs: int) -> tuple[float, float]:
    """Training SNR range for ``epoch``: the floor falls linearly from
    ``curriculum_snr`` to ``snr_min`` over the first ``curriculum_fraction`` of
    the epochs (loud signals first, as in George & Huerta 2018)."""
    start = max(cfg.curriculum_snr, cfg.snr_min)
    ramp = cfg.curriculum_fraction * epochs
    t = min(epoch / ramp, 1.0) if ramp > 0 else 1.0
    floor = start + (cfg.snr_min - start) * t
    return (min(floor, cfg.snr_max), cfg.snr_max)


def efficiency_at_fap(noise_scores: np.ndarray, signal_scores: np.ndarray, fap: float) -> tuple[float, float]:
    """(threshold, efficiency): the threshold exceeded by a fraction ``fap`` of
    noise windows, and the fraction of signal windows above it."""
    noise_scores = np.sort(np.asarray(noise_scores, dtype=np.float64))
    n = len(noise_scores)
    k = int(np.floor(fap * n))
    if k < 1:
        raise ValueError(f"FAP {fap} needs more than {n} noise windows (at least {int(np.ceil(1 / fap))})")
    threshold = noise_scores[n - k - 1]
    # strictly above the (k+1)-th loudest noise score: at most k noise windows pass
    return float(threshold), float(np.mean(np.asarray(signal_scores) > threshold))


class GWApp(App):
    name = "gw"
    config_cls = GWConfig
    monitor = Monitor("val_loss", "min")
    packages = ("lalsuite", "pycbc", "scipy")
    default_precision = "bf16"  # 1.6x fp32 training throughput here, same validation efficiency (README)

    @property
    def evaluate_config_cls(self) -> type:  # type: ignore[override]
        from .evaluate import GWEvalConfig

        return GWEvalConfig

    def learning_problem(self, cfg: GWConfig, options: Any = None) -> Any:
        """Binaries from the prior, scored on a window in noise (:class:`.learning.GWLearning`)."""
        from .learning import GWLearning

        return GWLearning(self, cfg)

    def schema(self, cfg: GWConfig) -> dict[str, ArraySpec]:
        if cfg.coherent:
            return {"signal": ArraySpec((len(cfg.network), cfg.stored_samples), "float32")}
        return {"signal": ArraySpec((cfg.stored_samples,), "float32")}

    def sample_parameters(self, cfg: GWConfig, rng: np.random.Generator) -> dict[str, float]:
        return sample_bbh_parameters(cfg, rng)

    def simulate(self, cfg: GWConfig, params: Mapping[str, float]) -> dict[str, np.ndarray]:
        return {"signal": whitened_signal(cfg, params).astype(np.float32)}

    def make_model(self, cfg: GWConfig) -> DetectionCNN:
        return DetectionCNN(cfg.window_samples, tuple(cfg.channels), cfg.hidden, len(cfg.network), cfg.conv_padding)

    def make_datasets(
        self, cfg: GWConfig, arrays: Mapping[str, np.ndarray], seed: int, val_fraction: float
    ) -> tuple[BatchSource, BatchSource]:
        signals = torch.from_numpy(np.ascontiguousarray(arrays["signal"], dtype=np.float32))
        n_val = max(1, int(round(val_fraction * len(signals))))
        if len(signals) - n_val < 1:
            raise ValueError(f"{len(signals)} stored signals are too few to split off a validation set")
        train = WindowSource(cfg, signals[:-n_val], seed=seed)
        val = WindowSource(cfg, signals[-n_val:], seed=seed + 1_000_003, fixed=True)
        return train, val

    def on_epoch_start(self, train_source: BatchSource, epoch: int, epochs: int) -> None:
        train_source.snr_range = curriculum_snr_range(train_source.cfg, epoch, epochs)  # type: ignore[attr-defined]

    def loss(self, cfg: GWConfig, output: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(output, batch["label"])

    def metrics(self, outputs: torch.Tensor, batches: Mapping[str, torch.Tensor]) -> dict[str, float]:
        label = batches["label"].bool().numpy()
        score = outputs.numpy()
        noise, signal = score[~label], score[label]
        out = {"accuracy": float(np.mean((score > 0) == label))}
        if len(noise) >= 100:
            out["efficiency_fap_1e-2"] = efficiency_at_fap(noise, signal, 1e-2)[1]
        return out

    def evaluate(self, run_dir: Path, data_dir: Path, out_dir: Path, **options: Any) -> dict:
        from .evaluate import evaluate_run

        return evaluate_run(self, Path(run_dir), Path(data_dir), Path(out_dir), **options)

    def serving_signature(self, cfg: GWConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        shape = (-1, len(cfg.network), cfg.window_samples) if cfg.coherent else (-1, cfg.window_samples)
        inputs = [TensorSpec("strain", "FP32", shape)]  # whitened, cfg.sample_rate
        outputs = [TensorSpec("logit", "FP32", (-1,)), TensorSpec("probability", "FP32", (-1,))]
        return inputs, outputs

    def serving_example(self, cfg: GWConfig, n: int, seed: int = 0) -> dict[str, np.ndarray]:
        """Whitened design-PSD noise windows: what the detector sees most of the time."""
        from .pipeline import whitened_noise

        return {"strain": whitened_noise(cfg, n, torch.Generator().manual_seed(seed)).numpy()}  # (n, T)

    def inference_model(self, model: DetectionCNN) -> DetectionCNN:
        """BatchNorm folded into each convolution (:meth:`DetectionCNN.for_inference`): 1.45x the model-alone
        throughput of a 16/32/64-channel network at batch 64 in bf16 on one core, the logits equal to bf16's
        rounding."""
        return model.for_inference(copy_model=False)

    def serve_predict(self, model: torch.nn.Module, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        logit = model(inputs["strain"]).float()
        return {"logit": logit, "probability": torch.sigmoid(logit)}

    uncertainty_label = "signal probability spread"

    def uncertainty(self, cfg: GWConfig, inputs: Mapping[str, np.ndarray], mean: Mapping[str, np.ndarray],
                    std: Mapping[str, np.ndarray]) -> np.ndarray:
        """The members' std of the signal probability, (B,). No ``simulate_inputs``: a window's
        matched-filter SNR is not the logit the surrogate serves, so gw cannot fall back to it."""
        return np.asarray(std["probability"], dtype=np.float64)

    bench_batch_size = 64

    def classical_baseline(self, cfg: GWConfig, device: torch.device, quick: bool = False) -> Any:
        """The matched-filter bank on the same windows (:mod:`.baseline`)."""
        from .baseline import matched_filter_baseline

        return matched_filter_baseline(cfg, device, quick)

    def accuracy_summary(self, cfg: GWConfig, report: Mapping[str, Any]) -> dict[str, Any]:
        from .baseline import efficiency_summary

        return efficiency_summary(report)

    def synthetic_batch(self, cfg: GWConfig, batch_size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """White-noise windows, half labelled signal (labels change no timing)."""
        shape = (batch_size, len(cfg.network), cfg.window_samples) if cfg.coherent else (batch_size, cfg.window_samples)
        return {"input": torch.randn(*shape, generator=generator),
                "label": (torch.rand(batch_size, generator=generator) < 0.5).float(), "snr": torch.zeros(batch_size)}

    def commands(self) -> dict:
        from .commands import detect, search

        return {"detect": detect, "search": search}

    def predict_file(self, run_dir: Path, path: Path, out: Path | None = None) -> Path:
        """Triggers of the CNN in a GWOSC-layout strain file at the run's FAP 1e-3 threshold (``detect``)."""
        from .detect import detect_file

        return Path(detect_file(path, run_dir, out=out)["out"])

    demo_by_default = True

    def demo(self, out: Path, quick: bool = False, workers: int = 2) -> dict:
        from .demo import QUICK, DemoSize, run_gw_demo

        return run_gw_demo(self, Path(out), QUICK if quick else DemoSize(), workers)

    def report_sections(self) -> list:
        from .report import SECTIONS

        return list(SECTIONS)

    def summary(self, report: dict) -> dict:
        keep = {}
        for method in ("cnn", "matched_filter"):
            keep[method] = {"efficiency": {fap: {s: round(e, 3) for s, e in by.items() if s in ("6", "8", "10")}
                                           for fap, by in report[method]["efficiency"].items()},
                            "seconds_per_strain_second": report[method]["seconds_per_strain_second"]}
        return {**keep, "speedup": round(report["speedup"], 1), "n_templates": report["n_templates"],
                "n_noise": report["n_noise"]}
