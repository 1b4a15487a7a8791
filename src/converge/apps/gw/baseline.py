"""The gw app's classical method for ``converge bench surrogate``: the matched-filter bank.

The maximum SNR over the shipped bank's templates, phase and merger time in the window
(:func:`~.matched_filter.matched_filter_snr`), on the same whitened noise windows the
CNN scores (``GWApp.serving_example``), one at a time and batched.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from ...contract import Baseline
from .bank import bank_path, load_bank, read_bank
from .config import GWConfig
from .matched_filter import TemplateBank, matched_filter_snr

QUICK_TEMPLATES, QUICK_WINDOWS = 8, 4  # a seconds-long bank for tests
WINDOWS_PER_CALL = 64  # windows per batched matched-filter call


def bank_for(cfg: GWConfig, templates: int = 0) -> TemplateBank:
    """The shipped bank for ``cfg``, or its first ``templates`` templates (0: all)."""
    if templates == 0:
        return load_bank(cfg)
    masses = np.asarray(read_bank(bank_path(cfg))["masses"], dtype=np.float64)[:templates]
    return TemplateBank.from_masses(cfg, masses)


def matched_filter_baseline(cfg: GWConfig, device: torch.device, quick: bool = False) -> Baseline:
    if cfg.coherent:
        raise NotImplementedError("the window matched filter is single-detector; a network's classical search is "
                                  "converge.apps.gw.mfsearch (converge search gw --method matched-filter)")
    bank = bank_for(cfg, QUICK_TEMPLATES if quick else 0).to(device)

    def run(inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return matched_filter_snr(inputs["strain"], bank)

    return Baseline(f"matched-filter bank, {len(bank)} templates", run, QUICK_WINDOWS if quick else WINDOWS_PER_CALL,
                    {"n_templates": len(bank), "sample": f"one whitened {cfg.window:g} s window at {cfg.sample_rate} Hz"})


def efficiency_summary(report: Mapping[str, Any]) -> dict[str, Any]:
    """Detection efficiency at each false-alarm probability for SNR 6, 8, 10: CNN beside matched filter."""
    out: dict[str, Any] = {"metric": "detection efficiency at a false-alarm probability per window, by optimal SNR",
                           "n_noise": report.get("n_noise")}
    for method in ("cnn", "matched_filter"):
        out[method] = {fap: {snr: eff for snr, eff in by_snr.items() if snr in ("6", "8", "10")}
                       for fap, by_snr in report[method]["efficiency"].items()}
    fap = min(out["cnn"], key=float)  # the strictest false-alarm probability evaluated
    cnn, mf = out["cnn"][fap].get("8"), out["matched_filter"].get(fap, {}).get("8")
    if cnn is not None and mf is not None:
        out["headline"] = f"efficiency at SNR 8, FAP {fap} per window: CNN {cnn:.3f}, matched filter {mf:.3f}"
    return out
