"""Simulator against surrogate: wall time per sample of each reference app, same machine, one run, with accuracy.

- gw: the matched-filter bank (:func:`~converge.apps.gw.matched_filter.matched_filter_snr`
  over the shipped bank, the classical detector) against the detection CNN, both
  scoring the same whitened noise windows, one at a time and batched.
- chem: a PySCF DFT single point (energy and forces, :func:`~converge.apps.chem.dft.dft_energy_forces`)
  on a conformer against the ANI potential's energy and forces on it, one
  molecule and a batch of copies (DFT has no batch: its per-sample time is the same).

The surrogate comes from a trained run when one is given, else it is an untrained
network of the same architecture (timing needs no skill; flagged ``trained: false``).
Accuracy is taken from the run's ``evaluation.json``, else from the repository's
``benchmarks/results/{gw,chem}.json``; ``accuracy.source`` says which.
``speedup = simulator time / surrogate time`` per sample, single and batched
(chem's batched ratio divides the one DFT time by the batched surrogate time).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .artifacts import pyplot, save_figure, write_json
from .machine import describe_machine

APPS = ("gw", "chem")
RESULTS_DIR = "benchmarks/results"  # relative to the working directory, as the scripts under benchmarks/ run


@dataclass(frozen=True)
class SurrogateBenchConfig:
    apps: tuple[str, ...] = APPS
    device: str = "cpu"  # cpu | cuda (the surrogate, the matched filter and, with gpu4pyscf, DFT)
    gw_run: str | None = None  # a `converge train` run of the gw app (default: untrained CNN)
    chem_run: str | None = None  # a chem run (default: untrained ANI potential for chem_molecule)
    gw_templates: int = 0  # 0: the whole shipped bank; k: its first k templates
    gw_windows: int = 64  # windows per batched matched-filter call
    batch_size: int = 256  # samples per batched surrogate call
    chem_molecule: str = "ethanol"  # without a chem run
    dft_level: str = "ani"  # the level the chem evaluation times (wB97X/6-31G(d)); fast: B3LYP/6-31G* DF
    n_dft: int = 1  # DFT single points timed (each on a new conformer)
    min_time_s: float = 1.0  # per timed call pattern
    results_dir: str = RESULTS_DIR
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.apps or set(self.apps) - set(APPS):
            raise ValueError(f"apps={self.apps}: choose from {', '.join(APPS)}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r}: give cpu or cuda")
        if self.gw_templates < 0 or self.gw_windows < 1 or self.batch_size < 1 or self.n_dft < 1:
            raise ValueError(f"gw_templates={self.gw_templates}, gw_windows={self.gw_windows}, "
                             f"batch_size={self.batch_size}, n_dft={self.n_dft}: need >= 0, >= 1, >= 1, >= 1")
        if not self.min_time_s > 0:
            raise ValueError(f"min_time_s={self.min_time_s}: must be > 0")

    @classmethod
    def quick(cls, device: str = "cpu") -> "SurrogateBenchConfig":
        """Seconds, for tests: 8 templates, water at the fast DFT level, short timings."""
        return cls(device=device, gw_templates=8, gw_windows=4, batch_size=16, chem_molecule="water",
                   dft_level="fast", min_time_s=0.05)


def time_per_sample(fn: Callable[[], Any], n_samples: int, device: torch.device, min_time_s: float,
                    max_calls: int = 100_000) -> dict[str, float]:
    """Seconds per sample of ``fn`` (which handles ``n_samples``): one untimed call, then calls until
    ``min_time_s``; on a GPU each call is synchronised (a caller waits for its answer)."""
    def call() -> None:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    call()
    calls, t0 = 0, time.perf_counter()
    while True:
        call()
        calls += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= min_time_s or calls >= max_calls:
            break
    return {"seconds_per_sample": elapsed / calls / n_samples, "calls": calls, "batch": n_samples}


def comparison(simulator: str, surrogate: str, sim_single: dict, sim_batched: dict | None, sur_single: dict,
               sur_batched: dict) -> dict[str, Any]:
    """The common layout of one app's entry; speed-ups are simulator over surrogate seconds per sample."""
    sim_b = (sim_batched or sim_single)["seconds_per_sample"]
    return {"simulator": simulator, "surrogate": surrogate,
            "simulator_seconds_per_sample": {"single": sim_single["seconds_per_sample"],
                                             "batched": sim_batched["seconds_per_sample"] if sim_batched else None},
            "simulator_batch": sim_batched["batch"] if sim_batched else 1,
            "surrogate_seconds_per_sample": {"single": sur_single["seconds_per_sample"],
                                             "batched": sur_batched["seconds_per_sample"]},
            "surrogate_batch": sur_batched["batch"],
            "speedup": {"single": sim_single["seconds_per_sample"] / sur_single["seconds_per_sample"],
                        "batched": sim_b / sur_batched["seconds_per_sample"]}}


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def accuracy_source(run: str | None, results_dir: str, app: str) -> tuple[Path | None, dict[str, Any] | None]:
    """The run's evaluation.json if there is one, else ``results_dir/APP.json``; (None, None) if neither."""
    for path in ([Path(run) / "evaluation.json"] if run else []) + [Path(results_dir) / f"{app}.json"]:
        report = read_json(path)
        if report is not None:
            return path, report
    return None, None


# -- gw --------------------------------------------------------------------------------------------------------------
def gw_accuracy(path: Path | None, report: dict[str, Any] | None) -> dict[str, Any]:
    """Detection efficiency at each false-alarm probability for SNR 6, 8, 10: CNN beside matched filter."""
    if report is None:
        return {"source": None, "note": "no gw evaluation found: run `converge evaluate gw` or benchmarks/gw_full.py"}
    out: dict[str, Any] = {"source": str(path), "metric": "detection efficiency at a false-alarm probability per "
                           "window, by optimal SNR", "n_noise": report.get("n_noise")}
    for method in ("cnn", "matched_filter"):
        out[method] = {fap: {snr: eff for snr, eff in by_snr.items() if snr in ("6", "8", "10")}
                       for fap, by_snr in report[method]["efficiency"].items()}
    return out


def gw_model(cfg: SurrogateBenchConfig, device: torch.device, accuracy_report: dict[str, Any] | None):
    """(model, GWConfig, precision, trained, description); untrained: the accuracy source's architecture."""
    from ..apps.gw.app import GWApp
    from ..apps.gw.config import GWConfig
    from ..config import from_dict
    from ..train.loop import load_model
    from ..train.precision import resolve_precision, run_precision

    app = GWApp()
    if cfg.gw_run:
        model, config = load_model(app, Path(cfg.gw_run), device=str(device))
        precision = run_precision(config, app.default_precision, device)
        return model, from_dict(GWConfig, config["app_config"], "app"), precision, True, f"trained run {cfg.gw_run}"
    app_cfg = from_dict(GWConfig, accuracy_report["app_config"], "app") if accuracy_report and \
        "app_config" in accuracy_report else GWConfig()
    model = app.make_model(app_cfg).to(device).eval()
    return (model, app_cfg, resolve_precision("auto", app.default_precision, device), False,
            "untrained, same architecture (timing only)")


def gw_bank(app_cfg, templates: int):
    """The shipped bank for ``app_cfg``, or its first ``templates`` templates."""
    from ..apps.gw.bank import bank_path, load_bank, read_bank
    from ..apps.gw.matched_filter import TemplateBank

    if templates == 0:
        return load_bank(app_cfg)
    masses = np.asarray(read_bank(bank_path(app_cfg))["masses"], dtype=np.float64)[:templates]
    return TemplateBank.from_masses(app_cfg, masses)


def run_gw(cfg: SurrogateBenchConfig, device: torch.device) -> dict[str, Any]:
    from ..apps.gw.matched_filter import matched_filter_snr
    from ..apps.gw.pipeline import whitened_noise
    from ..train.loop import autocast_context

    path, report = accuracy_source(cfg.gw_run, cfg.results_dir, "gw")
    model, app_cfg, precision, trained, description = gw_model(cfg, device, report)
    bank = gw_bank(app_cfg, cfg.gw_templates).to(device)
    n = max(cfg.batch_size, cfg.gw_windows)
    windows = whitened_noise(app_cfg, n, torch.Generator().manual_seed(cfg.seed)).to(device)  # (n, N)

    def cnn(x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode(), autocast_context(device, precision):
            return model(x)

    t = cfg.min_time_s
    mf_single = time_per_sample(lambda: matched_filter_snr(windows[:1], bank), 1, device, t)
    mf_batched = time_per_sample(lambda: matched_filter_snr(windows[:cfg.gw_windows], bank), cfg.gw_windows, device,
                                 t)
    cnn_single = time_per_sample(lambda: cnn(windows[:1]), 1, device, t)
    cnn_batched = time_per_sample(lambda: cnn(windows[:cfg.batch_size]), cfg.batch_size, device, t)
    out = comparison(f"matched-filter bank, {len(bank)} templates", f"DetectionCNN, {description}", mf_single,
                     mf_batched, cnn_single, cnn_batched)
    return {**out, "trained": trained, "precision": precision, "n_templates": len(bank),
            "sample": f"one whitened {app_cfg.window:g} s window at {app_cfg.sample_rate} Hz",
            "accuracy": gw_accuracy(path, report)}


# -- chem ------------------------------------------------------------------------------------------------------------
def chem_accuracy(path: Path | None, report: dict[str, Any] | None, molecule: str) -> dict[str, Any]:
    """Energy and force errors against DFT: from an evaluation.json, or the molecule's entry of chem.json."""
    if report is not None and "energy_mae_kcal_mol" not in report:
        report = report.get(molecule)  # benchmarks/results/chem.json holds one entry per molecule
    if report is None:
        return {"source": None, "note": f"no chem evaluation of {molecule} found: run `converge evaluate chem`"}
    keys = ("energy_mae_kcal_mol", "energy_rmse_kcal_mol", "force_mae_kcal_mol_A", "hot_energy_mae_kcal_mol",
            "hot_force_mae_kcal_mol_A", "level_of_theory")
    return {"source": str(path), "molecule": molecule, **{k: report[k] for k in keys if k in report}}


def chem_model(cfg: SurrogateBenchConfig, device: torch.device):
    """(model, ChemConfig, trained, description)."""
    from ..apps.chem.app import ChemApp
    from ..apps.chem.config import ChemConfig
    from ..apps.chem.model import from_config
    from ..config import from_dict
    from ..train.loop import load_model

    if cfg.chem_run:
        model, config = load_model(ChemApp(), Path(cfg.chem_run), device=str(device))
        return model, from_dict(ChemConfig, config["app_config"], "app"), True, f"trained run {cfg.chem_run}"
    app_cfg = ChemConfig(molecule=cfg.chem_molecule)
    return from_config(app_cfg).to(device).eval(), app_cfg, False, "untrained, same architecture (timing only)"


def run_chem(cfg: SurrogateBenchConfig, device: torch.device) -> dict[str, Any]:
    from ..apps.chem.dft import dft_energy_forces
    from ..apps.chem.molecules import get_molecule

    model, app_cfg, trained, description = chem_model(cfg, device)
    mol = get_molecule(app_cfg.molecule)
    rng = np.random.default_rng(cfg.seed)
    conformers = [mol.positions + rng.normal(0.0, 0.05, mol.positions.shape) for _ in range(cfg.n_dft)]
    dft_cfg = replace(app_cfg, level=cfg.dft_level)
    from pyscf import dft, grad, gto  # noqa: F401  imported before the clock starts

    t0 = time.perf_counter()
    for positions in conformers:
        dft_energy_forces(list(mol.symbols), positions, dft_cfg, use_gpu=None if device.type == "cuda" else False,
                          threads=torch.get_num_threads())
    dft_time = {"seconds_per_sample": (time.perf_counter() - t0) / cfg.n_dft, "calls": cfg.n_dft, "batch": 1}
    species = torch.as_tensor(mol.atomic_numbers, dtype=torch.int64, device=device)[None]  # (1, A)
    coords = torch.as_tensor(conformers[0], dtype=model.energy_scale.dtype, device=device)[None]  # (1, A, 3)
    b = cfg.batch_size
    single = time_per_sample(lambda: model.energies_forces(species, coords), 1, device, cfg.min_time_s)
    batched = time_per_sample(lambda: model.energies_forces(species.expand(b, -1), coords.expand(b, -1, -1)), b,
                              device, cfg.min_time_s)
    path, report = accuracy_source(cfg.chem_run, cfg.results_dir, "chem")
    out = comparison(f"DFT energy + forces, {dft_cfg.level_of_theory} (PySCF)", f"ANIPotential, {description}",
                     dft_time, None, single, batched)
    return {**out, "trained": trained, "molecule": app_cfg.molecule, "n_atoms": len(mol.symbols),
            "sample": "one conformer: the G2 geometry displaced by N(0, 0.05 A) per coordinate",
            "accuracy": chem_accuracy(path, report, app_cfg.molecule)}


# -- the benchmark ---------------------------------------------------------------------------------------------------
def run_surrogate_benchmark(cfg: SurrogateBenchConfig = SurrogateBenchConfig()) -> dict[str, Any]:
    """Each app of ``cfg`` in turn; see the module docstring."""
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device cuda but CUDA is not available; use --device cpu")
    runners = {"gw": run_gw, "chem": run_chem}
    t0 = time.perf_counter()
    apps = {name: runners[name](cfg, device) for name in cfg.apps}
    return {"device": device.type, "threads": torch.get_num_threads(), "config": asdict(cfg), "apps": apps,
            "seconds": time.perf_counter() - t0, "machine": describe_machine()}


def plot_surrogate(result: dict[str, Any], path: str | Path) -> Path:
    """Seconds per sample, log scale: simulator and surrogate, single and batched, one panel per app."""
    plt = pyplot()
    from matplotlib.patches import Patch

    apps = result["apps"]
    fig, axes = plt.subplots(1, len(apps), figsize=(6.5 * len(apps), 4.2), squeeze=False)
    for ax, (name, entry) in zip(axes[0], apps.items()):
        bars = [("simulator, single", entry["simulator_seconds_per_sample"]["single"], "tab:orange"),
                (f"simulator, batch {entry['simulator_batch']}", entry["simulator_seconds_per_sample"]["batched"],
                 "tab:orange"),
                ("surrogate, single", entry["surrogate_seconds_per_sample"]["single"], "tab:blue"),
                (f"surrogate, batch {entry['surrogate_batch']}", entry["surrogate_seconds_per_sample"]["batched"],
                 "tab:blue")]
        bars = [b for b in bars if b[1] is not None]
        y = np.arange(len(bars))
        ax.barh(y, [b[1] for b in bars], color=[b[2] for b in bars], alpha=0.8)
        for k, (_, value, _) in enumerate(bars):
            ax.annotate(f"{value:.3g} s", (value, k), xytext=(3, 0), textcoords="offset points", va="center",
                        fontsize=8)
        ax.set_yticks(y, [b[0] for b in bars])
        ax.invert_yaxis()
        values = [b[1] for b in bars]
        ax.set_xlim(10 ** np.floor(np.log10(min(values))), 6 * max(values))  # from a round decade; room for labels
        ax.legend(handles=[Patch(color="tab:orange", alpha=0.8, label=entry["simulator"]),
                           Patch(color="tab:blue", alpha=0.8, label=entry["surrogate"])], fontsize=7,
                  loc="lower right")
        speed = entry["speedup"]
        flag = "" if entry["trained"] else "\n(untrained surrogate: timing only)"
        ax.set(xscale="log", xlabel="seconds per sample",
               title=f"{name}: speed-up {speed['single']:.3g}x single, {speed['batched']:.3g}x batched{flag}")
        ax.title.set_fontsize(10)
        ax.grid(True, axis="x", which="both", alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, path)


def write_results(result: dict[str, Any], out_dir: str | Path, stem: str = "surrogate") -> tuple[Path, Path]:
    """``OUT/STEM.json`` and ``OUT/STEM.png``, each written atomically."""
    out_dir = Path(out_dir)
    return write_json(out_dir / f"{stem}.json", result), plot_surrogate(result, out_dir / f"{stem}.png")


def headline(result: dict[str, Any]) -> dict[str, Any]:
    return {name: {"speedup": {k: float(f"{v:.3g}") for k, v in e["speedup"].items()}, "trained": e["trained"],
                   "accuracy_source": e["accuracy"].get("source")} for name, e in result["apps"].items()}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m converge.bench.surrogate [--apps gw,chem] [--gw-run RUN] [--chem-run RUN] [--out DIR]``."""
    parser = argparse.ArgumentParser(prog="converge bench surrogate", description=__doc__.split("\n")[0])
    parser.add_argument("--apps", default=",".join(APPS), help="gw, chem or gw,chem")
    parser.add_argument("--device", default="cpu", help="cpu | cuda")
    parser.add_argument("--gw-run", default=None, help="a trained gw run (default: untrained CNN, flagged)")
    parser.add_argument("--chem-run", default=None, help="a trained chem run (default: untrained potential)")
    parser.add_argument("--molecule", default="ethanol", help="chem molecule without --chem-run")
    parser.add_argument("--dft-level", default="ani", help="fast | ani | custom (the run's custom settings)")
    parser.add_argument("--templates", type=int, default=0, help="first K bank templates (0: the whole bank)")
    parser.add_argument("--batch-size", type=int, default=256, help="surrogate batch")
    parser.add_argument("--threads", type=int, default=1, help="torch and PySCF threads")
    parser.add_argument("--results-dir", default=RESULTS_DIR, help="where gw.json / chem.json give the accuracy")
    parser.add_argument("--quick", action="store_true", help="seconds-long smoke configuration")
    parser.add_argument("--out", type=Path, default=Path("."), help="where STEM.json and STEM.png go")
    parser.add_argument("--stem", default="surrogate", help="file name stem, e.g. surrogate_gpu")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        base = SurrogateBenchConfig.quick(args.device) if args.quick else SurrogateBenchConfig(
            device=args.device, chem_molecule=args.molecule, dft_level=args.dft_level, gw_templates=args.templates,
            batch_size=args.batch_size)
        cfg = replace(base, apps=tuple(a.strip() for a in args.apps.split(",")), gw_run=args.gw_run,
                      chem_run=args.chem_run, results_dir=args.results_dir)
        result = run_surrogate_benchmark(cfg)
    except (ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    paths = write_results(result, args.out, args.stem)
    print(json.dumps(headline(result), indent=2))
    print(f"written {paths[0]} and {paths[1]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
