"""Template bank: stochastic placement, coverage, and the shipped JSON bank.

Match. A signal's fitting factor against a bank is the matched-filter SNR
(:func:`converge.apps.gw.matched_filter.matched_filter_snr`, maximised over templates,
merger time and phase) of its unit-norm whitened window: exactly what the baseline
detector recovers, as a fraction of the optimal SNR in the window. Signals are
placed with their merger at the latest searched sample (``merger_max``), where a
window holds the most inspiral and matching is hardest. Templates are face-on
(``h_+``, two quadratures); for zero-spin IMRPhenomD (the l=|m|=2 mode only) any
orientation's detector response is ``h_+`` up to amplitude and phase, so this loses nothing.

Placement (stochastic, as in Harry, Allen & Sathyaprakash 2009, arXiv:0908.2090):
propose masses uniformly on ``{mass_min <= m2 <= m1 <= mass_max}`` (the training
distribution), add the proposal to the bank when its fitting factor is below
``min_match``, stop after ``max_rejections`` consecutive proposals already covered.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from .config import GWConfig
from .matched_filter import TemplateBank, default_valid, matched_filter_snr
from .waveforms import sample_bbh_parameters, whitened_signal

BANK_FORMAT = "converge.gw.template_bank/1"
# GWConfig fields a bank depends on; load_bank refuses a bank made with other values.
MATCHING_FIELDS = ("sample_rate", "window", "f_lower", "psd", "approximant", "mass_min", "mass_max")
DATA_DIR = Path(__file__).parent / "data"


def bank_path(cfg: GWConfig | None = None, min_match: float = 0.97) -> Path:
    """Path of the shipped bank for ``cfg`` (default config: ``data/bank_5-95_mm0.97.json``; templates are detector-independent)."""
    cfg = cfg or GWConfig()
    return DATA_DIR / f"bank_{cfg.mass_min:g}-{cfg.mass_max:g}_mm{min_match:g}.json"


def signal_windows(cfg: GWConfig, stored: np.ndarray, merger_sample: int) -> torch.Tensor:
    """Unit-norm windows (B, N) cut from stored whitened signals (B, stored_samples) with the merger at
    window sample ``merger_sample``; ``merger_sample`` must be in ``[round(merger_min fs), round(merger_max fs)]``."""
    start = cfg.merger_index - merger_sample
    if not 0 <= start <= cfg.stored_samples - cfg.window_samples:
        raise ValueError(f"merger_sample={merger_sample} is outside the stored merger range {default_valid(cfg)}")
    windows = np.asarray(stored, dtype=np.float64)[..., start : start + cfg.window_samples]
    windows = windows / np.linalg.norm(windows, axis=-1, keepdims=True)
    return torch.as_tensor(windows, dtype=torch.float32).reshape(-1, cfg.window_samples)


def fitting_factors(
    cfg: GWConfig, bank: TemplateBank, params: Sequence[Mapping[str, float]], merger_sample: int | None = None
) -> np.ndarray:
    """Fitting factor (recovered / optimal SNR in the window) of each signal ``params`` against ``bank``.

    ``merger_sample`` defaults to the latest searched merger sample. Returns (len(params),) float64.
    """
    merger_sample = bank.valid[1] - 1 if merger_sample is None else merger_sample
    out = []
    for first in range(0, len(params), 256):
        stored = np.stack([whitened_signal(cfg, p) for p in params[first : first + 256]])
        out.append(matched_filter_snr(signal_windows(cfg, stored, merger_sample), bank).snr.numpy())
    return np.concatenate(out).astype(np.float64)


def chirp_mass_eta(masses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Chirp mass ``(m1 m2)^(3/5) / M^(1/5)`` [Msun] and symmetric mass ratio ``m1 m2 / M^2`` of (T, 2) masses."""
    m1, m2 = masses[..., 0], masses[..., 1]
    total = m1 + m2
    return (m1 * m2) ** 0.6 / total**0.2, m1 * m2 / total**2


def nearest_templates(masses: np.ndarray, m1: float, m2: float, k: int) -> np.ndarray:
    """Indices of the ``k`` templates closest to ``(m1, m2)`` in ``(ln Mc, eta)`` (a heuristic
    ordering only: placement uses it to try likely matches first, never to accept)."""
    mc, eta = chirp_mass_eta(masses)
    mc0, eta0 = chirp_mass_eta(np.array([m1, m2]))
    distance = (np.log(mc / mc0) / 0.02) ** 2 + ((eta - eta0) / 0.02) ** 2
    return np.argsort(distance)[:k]


def place_bank(
    cfg: GWConfig,
    min_match: float = 0.97,
    rng: np.random.Generator | None = None,
    max_rejections: int = 200,
    max_templates: int = 5000,
    progress: Callable[[int, int], None] | None = None,
    neighbours: int = 48,
) -> np.ndarray:
    """Stochastic template placement over the mass range; returns masses (T, 2) [Msun], ``m1 >= m2``.

    See the module docstring. Each proposal is first filtered against its ``neighbours``
    nearest templates in (ln Mc, eta); only when none of them covers it is the whole bank
    searched, so acceptances are exact. ``progress(n_proposals, n_templates)`` is called
    after each acceptance.
    """
    if not 0 < min_match < 1:
        raise ValueError(f"min_match={min_match} must be strictly between 0 and 1")
    rng = rng if rng is not None else np.random.default_rng(0)
    masses = np.zeros((0, 2))
    bank = None
    merger_sample = default_valid(cfg)[1] - 1
    rejected, proposals = 0, 0
    while rejected < max_rejections and len(masses) < max_templates:
        p = sample_bbh_parameters(cfg, rng)
        proposals += 1
        if bank is not None:
            face_on = {"mass1": p["mass1"], "mass2": p["mass2"]}
            window = signal_windows(cfg, whitened_signal(cfg, face_on)[None], merger_sample)
            near = bank.select(nearest_templates(masses, p["mass1"], p["mass2"], neighbours))
            if matched_filter_snr(window, near).snr.item() >= min_match or (
                len(bank) > neighbours and matched_filter_snr(window, bank).snr.item() >= min_match
            ):
                rejected += 1
                continue
        rejected = 0
        masses = np.vstack([masses, [p["mass1"], p["mass2"]]])
        new = TemplateBank.from_masses(cfg, masses[-1:])
        bank = new if bank is None else bank.concat(new)
        if progress is not None:
            progress(proposals, len(masses))
    return masses


def measure_coverage(
    cfg: GWConfig, bank: TemplateBank, min_match: float, n_signals: int = 1000, seed: int = 12345
) -> dict[str, Any]:
    """Fitting factors of ``n_signals`` random signals (:func:`sample_bbh_parameters`, any orientation)."""
    rng = np.random.default_rng(seed)
    ff = fitting_factors(cfg, bank, [sample_bbh_parameters(cfg, rng) for _ in range(n_signals)])
    return {
        "n_signals": n_signals,
        "seed": seed,
        "merger_sample": bank.valid[1] - 1,
        "fraction_at_least_min_match": float(np.mean(ff >= min_match)),
        "min_fitting_factor": float(ff.min()),
        "fitting_factor_percentiles": {str(q): float(np.percentile(ff, q)) for q in (0.1, 1, 5, 50)},
    }


def _content_hash(record: Mapping[str, Any]) -> str:
    body = {k: v for k, v in record.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def write_bank(path: Path, cfg: GWConfig, masses: np.ndarray, min_match: float, **provenance: Any) -> dict[str, Any]:
    """Write the bank JSON atomically (temp file, re-read and verified, then renamed); returns the record."""
    record: dict[str, Any] = {
        "format": BANK_FORMAT,
        "n_templates": int(len(masses)),
        "min_match": float(min_match),
        "config": {name: getattr(cfg, name) for name in MATCHING_FIELDS + ("segment", "merger_min", "merger_max")},
        **provenance,
        "masses": [[round(float(m1), 6), round(float(m2), 6)] for m1, m2 in masses],
    }
    record["sha256"] = _content_hash(record)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    if _content_hash(json.loads(tmp.read_text())) != record["sha256"]:
        raise OSError(f"{tmp} did not read back identically; disk problem?")
    os.replace(tmp, path)
    return record


def read_bank(path: Path) -> dict[str, Any]:
    """The bank record of a JSON file, its format and content hash checked."""
    record = json.loads(Path(path).read_text())
    if record.get("format") != BANK_FORMAT or record.get("sha256") != _content_hash(record):
        raise ValueError(f"{path} is not an intact {BANK_FORMAT} file (format or sha256 mismatch)")
    return record


def load_bank(cfg: GWConfig, path: Path | str | None = None, min_match: float = 0.97) -> TemplateBank:
    """The :class:`TemplateBank` of the bank file for ``cfg`` (default :func:`bank_path`).

    Raises ``ValueError`` when the file is missing or was made for other settings.
    """
    path = Path(path) if path is not None else bank_path(cfg, min_match)
    how = "make one with `python -m converge.apps.gw.bank --out PATH` (or bank.place_bank + bank.write_bank)"
    if not path.is_file():
        raise ValueError(f"no template bank at {path} for this config; {how}")
    record = read_bank(path)
    stored = record["config"]
    wrong = [f"{k}={getattr(cfg, k)!r} (bank: {stored.get(k)!r})"
             for k in MATCHING_FIELDS if stored.get(k) != getattr(cfg, k)]
    if wrong:
        raise ValueError(f"template bank {path} was placed for other settings: {', '.join(wrong)}; {how}")
    return TemplateBank.from_masses(cfg, np.array(record["masses"], dtype=np.float64))


def main(argv: Sequence[str] | None = None) -> None:
    """Place a bank for the default GWConfig (masses optionally overridden) and write its JSON."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--min-match", type=float, default=0.97)
    parser.add_argument("--max-rejections", type=int, default=2000)  # the shipped bank: 1053 templates, ~7 min
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mass-min", type=float, default=GWConfig.mass_min)
    parser.add_argument("--mass-max", type=float, default=GWConfig.mass_max)
    parser.add_argument("--coverage-signals", type=int, default=1000)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cfg = GWConfig(mass_min=args.mass_min, mass_max=args.mass_max)
    t0 = time.perf_counter()
    masses = place_bank(
        cfg, args.min_match, np.random.default_rng(args.seed), args.max_rejections,
        progress=lambda p, t: print(f"proposals {p:6d}  templates {t:5d}", flush=True),
    )
    seconds = time.perf_counter() - t0
    coverage = measure_coverage(cfg, TemplateBank.from_masses(cfg, masses), args.min_match, args.coverage_signals)
    from importlib.metadata import version

    placement = {
        "method": "stochastic (converge.apps.gw.bank.place_bank)",
        "seed": args.seed,
        "max_rejections": args.max_rejections,
        "match": "matched_filter_snr of the proposal's unit-norm face-on whitened window, merger at merger_max",
        "seconds": round(seconds, 1),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": {name: version(name) for name in ("lalsuite", "pycbc", "numpy", "torch")},
    }
    record = write_bank(args.out or bank_path(cfg, args.min_match), cfg, masses, args.min_match,
                        placement=placement, coverage=coverage)
    print(json.dumps({k: v for k, v in record.items() if k != "masses"}, indent=1))


if __name__ == "__main__":
    main()
