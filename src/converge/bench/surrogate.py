"""Simulator against surrogate: wall time per sample of each app, same machine, one run, with accuracy.

For each app, its classical method (``App.classical_baseline``: gw the matched-filter
bank, chem a DFT single point at the run's level of theory) and the surrogate
(``App.serve_predict``, what ``converge serve`` runs) answer the same inputs
(``App.serving_example``), one at a time and batched, each with one untimed call
first and the same statistic (mean seconds per sample over calls filling
``min_time_s``).

The surrogate comes from a trained run when one is given (``--run APP=RUN``), else it
is an untrained network of the same architecture (timing needs no skill; flagged
``trained: false``). Accuracy is taken from the run's ``evaluation.json``, else from the
repository's ``benchmarks/results/APP.json`` (``App.accuracy_summary`` picks the figures);
``accuracy.source`` says which. ``speedup = simulator time / surrogate time`` per sample,
single and batched (a simulator with no batch: its one time over the batched surrogate time).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from .artifacts import pyplot, save_figure, write_json
from .machine import describe_machine

RESULTS_DIR = "benchmarks/results"  # relative to the working directory, as the scripts under benchmarks/ run


def baseline_apps() -> tuple[str, ...]:
    """The installed apps that name a classical baseline (``App.classical_baseline``)."""
    from ..contract import app_classes

    return tuple(name for name, cls in app_classes()[0].items() if cls.provides("classical_baseline"))


@dataclass(frozen=True)
class SurrogateBenchConfig:
    apps: tuple[str, ...] = field(default_factory=baseline_apps)
    device: str = "cpu"  # cpu | cuda (the surrogate, and the baseline where it runs there)
    runs: tuple[tuple[str, str], ...] = ()  # (app, run folder): trained surrogates (else untrained)
    app_overrides: tuple[tuple[str, str, str], ...] = ()  # (app, key, value) of the app config, without a run
    batch_size: int = 256  # samples per batched surrogate call
    quick: bool = False  # the apps' seconds-long baselines (App.classical_baseline(quick=True))
    min_time_s: float = 1.0  # per timed call pattern
    results_dir: str = RESULTS_DIR
    seed: int = 0

    def __post_init__(self) -> None:
        known = baseline_apps()
        if not self.apps or set(self.apps) - set(known):
            raise ValueError(f"apps={self.apps}: choose from {', '.join(known)} (the installed apps with a "
                             "classical baseline)")
        if set(dict(self.runs)) - set(self.apps):
            raise ValueError(f"runs for {sorted(set(dict(self.runs)) - set(self.apps))}: not among apps={self.apps}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r}: give cpu or cuda")
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size}: need >= 1")
        if not self.min_time_s > 0:
            raise ValueError(f"min_time_s={self.min_time_s}: must be > 0")

    @classmethod
    def fast(cls, device: str = "cpu", **changes: Any) -> "SurrogateBenchConfig":
        """Seconds, for tests: the apps' quick baselines, small batches, short timings."""
        return cls(device=device, batch_size=16, quick=True, min_time_s=0.05, **changes)


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


def accuracy_entry(app: Any, app_cfg: Any, path: Path | None, report: Mapping[str, Any] | None) -> dict[str, Any]:
    """``App.accuracy_summary`` of the accuracy source, with the source named (or a note saying how to get one)."""
    if report is None:
        return {"source": None, "note": f"no {app.name} evaluation found: run `converge evaluate {app.name}`"}
    found = app.accuracy_summary(app_cfg, report)
    return {"source": None if "note" in found else str(path), **found}


def surrogate_model(app: Any, run: str | None, device: torch.device, overrides: Mapping[str, str],
                    accuracy_report: Mapping[str, Any] | None):
    """(model, app config, precision, trained, description); untrained: the accuracy source's architecture."""
    from ..config import from_dict, load_section
    from ..train.loop import load_model
    from ..train.precision import resolve_precision, run_precision

    if run:
        model, config = load_model(app, Path(run), device=str(device))
        precision = run_precision(config, app.default_precision, device)
        return model, from_dict(app.config_cls, config["app_config"], "app"), precision, True, f"trained run {run}"
    base = dict((accuracy_report or {}).get("app_config") or {})
    app_cfg = load_section(app.config_cls, {"app": base}, "app", dict(overrides))
    model = app.make_model(app_cfg).to(device).eval()
    return (model, app_cfg, resolve_precision("auto", app.default_precision, device), False,
            "untrained, same architecture (timing only)")


def run_app(name: str, cfg: SurrogateBenchConfig, device: torch.device) -> dict[str, Any]:
    """One app's entry: its baseline and its surrogate on the same served inputs."""
    from ..contract import load_app
    from ..train.loop import autocast_context

    app = load_app(name)
    run = dict(cfg.runs).get(name)
    path, report = accuracy_source(run, cfg.results_dir, name)
    overrides = {key: value for a, key, value in cfg.app_overrides if a == name}
    model, app_cfg, precision, trained, description = surrogate_model(app, run, device, overrides, report)
    baseline = app.classical_baseline(app_cfg, device, quick=cfg.quick)
    n = max(cfg.batch_size, baseline.batch)
    inputs = {k: torch.as_tensor(np.ascontiguousarray(v)).to(device)
              for k, v in app.serving_example(app_cfg, n, seed=cfg.seed).items()}

    def first(k: int) -> dict[str, torch.Tensor]:
        return {key: value[:k] for key, value in inputs.items()}

    def surrogate(x: Mapping[str, torch.Tensor]) -> Any:
        grad_mode = torch.enable_grad() if app.grad_at_inference else torch.inference_mode()
        with grad_mode, autocast_context(device, precision):
            return app.serve_predict(model, x)

    t, b = cfg.min_time_s, cfg.batch_size
    one, batch, sim_batch = first(1), first(b), first(baseline.batch)
    sim_single = time_per_sample(lambda: baseline.run(one), 1, device, t)
    sim_batched = time_per_sample(lambda: baseline.run(sim_batch), baseline.batch, device, t) \
        if baseline.batch > 1 else None
    sur_single = time_per_sample(lambda: surrogate(one), 1, device, t)
    sur_batched = time_per_sample(lambda: surrogate(batch), b, device, t)
    out = comparison(baseline.name, f"{type(model).__name__}, {description}", sim_single, sim_batched, sur_single,
                     sur_batched)
    return {**out, **baseline.details, "trained": trained, "precision": precision,
            "accuracy": accuracy_entry(app, app_cfg, path, report)}


# -- the benchmark ---------------------------------------------------------------------------------------------------
def run_surrogate_benchmark(cfg: SurrogateBenchConfig | None = None) -> dict[str, Any]:
    """Each app of ``cfg`` (default: every installed app with a baseline) in turn; see the module docstring."""
    cfg = cfg or SurrogateBenchConfig()
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device cuda but CUDA is not available; use --device cpu")
    t0 = time.perf_counter()
    apps = {name: run_app(name, cfg, device) for name in cfg.apps}
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


def parse_pairs(items: Sequence[str], what: str, example: str) -> list[tuple[str, str]]:
    """``["gw=runs/gw", ...]`` -> ``[("gw", "runs/gw"), ...]``, or a ValueError saying how to write one."""
    pairs = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ValueError(f"{what} {item!r}: write it as {example}")
        pairs.append((key.strip(), value.strip()))
    return pairs


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m converge.bench.surrogate [--apps A,B] [--run APP=RUN ...] [--set APP.key=value ...] [--out DIR]``."""
    parser = argparse.ArgumentParser(prog="converge bench surrogate", description=__doc__.split("\n")[0])
    parser.add_argument("--apps", default=None, help="comma-separated app names (default: every installed app "
                                                     "with a classical baseline)")
    parser.add_argument("--device", default="cpu", help="cpu | cuda")
    parser.add_argument("--run", action="append", default=[], metavar="APP=RUN",
                        help="a trained run of APP (repeatable; default: an untrained network, flagged)")
    parser.add_argument("--set", action="append", default=[], dest="sets", metavar="APP.KEY=VALUE",
                        help="an app config key without a run, e.g. chem.molecule=water or chem.level=ani "
                             "(repeatable)")
    parser.add_argument("--batch-size", type=int, default=256, help="surrogate batch")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (and the baseline's, e.g. PySCF)")
    parser.add_argument("--results-dir", default=RESULTS_DIR, help="where APP.json gives the accuracy")
    parser.add_argument("--quick", action="store_true", help="the apps' seconds-long baselines, short timings")
    parser.add_argument("--out", type=Path, default=Path("."), help="where STEM.json and STEM.png go")
    parser.add_argument("--stem", default="surrogate", help="file name stem, e.g. surrogate_gpu")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        runs = tuple(parse_pairs(args.run, "--run", "APP=RUN, e.g. gw=runs/gw"))
        sets = []
        for key, value in parse_pairs(args.sets, "--set", "APP.KEY=VALUE, e.g. chem.level=ani"):
            app, dot, name = key.partition(".")
            if not dot or not name:
                raise ValueError(f"--set {key}={value}: write APP.KEY=VALUE, e.g. chem.level=ani")
            sets.append((app, name, value))
        apps = tuple(a.strip() for a in args.apps.split(",") if a.strip()) if args.apps else baseline_apps()
        options = dict(apps=apps, device=args.device, runs=runs, app_overrides=tuple(sets), results_dir=args.results_dir)
        cfg = SurrogateBenchConfig.fast(**options) if args.quick else SurrogateBenchConfig(
            batch_size=args.batch_size, **options)
        result = run_surrogate_benchmark(cfg)
    except (ValueError, RuntimeError, KeyError) as err:
        print(f"error: {str(err).strip(chr(39))}", file=sys.stderr)
        return 2
    paths = write_results(result, args.out, args.stem)
    print(json.dumps(headline(result), indent=2))
    print(f"written {paths[0]} and {paths[1]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
