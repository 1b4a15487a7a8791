"""The gw app's own subcommands (``App.commands``): ``converge detect gw ...``, ``converge search gw ...``."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ...contract import CommandError


def detect(
    strain: Path = typer.Argument(..., help="Strain file in the GWOSC HDF5 layout (strain/Strain, meta/GPSstart)."),
    run: Path = typer.Option(..., "--run", "-r", help="A trained gw run directory."),
    threshold: Optional[float] = typer.Option(None, help="Trigger threshold on the CNN logit "
                                              "(default: the run's FAP 1e-3 threshold from evaluation.json)."),
    stride: float = typer.Option(0.125, help="Seconds between window starts."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Triggers JSON (default STRAIN.triggers.json)."),
) -> None:
    """Slide the gw CNN along a strain file: Welch PSD, whitening, triggers (GPS time, score)."""
    from rich.console import Console

    from ...train.checkpoint import CheckpointError
    from .detect import StrainFileError, detect_file

    try:
        result = detect_file(strain, run, threshold=threshold, stride=stride, out=out)
    except (StrainFileError, FileNotFoundError, ValueError, CheckpointError) as err:
        raise CommandError(str(err)) from err
    for trig in result["triggers"]:
        print(f"GPS {trig['gps_time']:.3f}  score {trig['score']:.2f}")
    Console(stderr=True).print(f"{len(result['triggers'])} trigger(s); {result['strain_seconds_per_second']:.0f} s "
                               f"of strain per second; written to {result['out']}")


def search(
    data: List[Path] = typer.Argument(None, help="An MLGWSC-1 file (a group per detector), or GWOSC files (one per "
                                      "detector, matched by GPS time) or a folder of them; not with --follow."),
    out: Path = typer.Option(..., "--out", "-o", help="Events file (HDF5: time, stat, var); a JSON summary "
                             "goes beside it (OUT.json)."),
    run: Optional[Path] = typer.Option(None, "--run", "-r", help="A trained gw run (the CNN search)."),
    method: str = typer.Option("cnn", help="cnn, or matched-filter (the classical baseline; its population "
                               "from --run's config or --dataset)."),
    dataset: Optional[int] = typer.Option(None, help="MLGWSC-1 dataset whose population the matched filter "
                                          "searches (its full-length bank), when no --run is given."),
    slides: int = typer.Option(0, help="0: the foreground (zero lag). N: the background of time slides 1..N "
                               "only (one detector shifted by multiples of --slide-step)."),
    slide_step: float = typer.Option(2.0, help="Seconds between time slides."),
    first_slide: int = typer.Option(1, help="The first slide's number (slides in groups: 1-40, 41-80, ...)."),
    background: Optional[Path] = typer.Option(None, help="A background events file (a --slides run): adds each "
                                              "event's FAR per month and per year."),
    follow: Optional[Path] = typer.Option(None, help="Analyse GWOSC files as they land in this folder (low "
                                          "latency); events and latencies are written as they happen."),
    follow_timeout: float = typer.Option(60.0, help="--follow: stop after this many seconds without a new file."),
    threshold: Optional[float] = typer.Option(None, help="CNN: logit a window needs to join an event (default 0). "
                                              "Matched filter: per-detector SNR of a trigger (default 5)."),
    stride: float = typer.Option(0.125, help="CNN: seconds between windows."),
    timing: Optional[Path] = typer.Option(None, help="A timing record (offset_s, var_s) measured on injections; "
                                          "default: the run's timing.json."),
    bank: Optional[Path] = typer.Option(None, help="Matched filter: a full-length bank JSON (default: the shipped "
                                        "one for the population)."),
    cache: Optional[Path] = typer.Option(None, help="Matched filter: folder of cached per-detector triggers "
                                         "(default OUT's folder/.mf-cache); a rerun resumes from it."),
    progress: bool = typer.Option(True, help="Show a progress bar."),
) -> None:
    """Search continuous multi-detector strain: whiten each detector with its own PSD, slide the coherent CNN
    (or filter with the template bank and require coincidence), cluster, write the challenge's event file."""
    from rich.console import Console

    from ...train.checkpoint import CheckpointError
    from .strainfile import StrainFileError

    try:
        summary = run_search(data, out, run, method, dataset, slides, slide_step, background, follow,
                             follow_timeout, threshold, stride, timing, bank, cache, progress, first_slide)
    except (StrainFileError, FileNotFoundError, ValueError, CheckpointError) as err:
        raise CommandError(str(err)) from err
    text = (f"{summary['n_events']} event(s) over {summary['analysed_s']:.0f} s analysed"
            + (f", {summary['background_s']:.0f} s of background" if summary.get("background_s") else "")
            + f"; {summary['seconds_per_strain_second'] * 1e3:.2f} ms per strain second; written to {out}")
    if "latency_ms" in summary:
        text += f"; latency p50 {summary['latency_ms']['p50']:.0f} ms, p99 {summary['latency_ms']['p99']:.0f} ms"
    Console(stderr=True).print(text)


def run_search(data, out, run, method, dataset, slides, slide_step, background, follow, follow_timeout,
               threshold, stride, timing, bank, cache, progress, first_slide=1) -> dict:
    """The search command's work, with plain arguments (the CLI's errors come from here)."""
    from .config import GWConfig
    from .search import SearchConfig, add_far, search_cnn

    if method not in ("cnn", "matched-filter"):
        raise ValueError(f"--method {method!r}: choose cnn or matched-filter")
    if follow is None and not data:
        raise ValueError("give the DATA to search, or --follow DIR")
    if follow is not None and data:
        raise ValueError("give either DATA or --follow DIR, not both")
    if follow is not None and slides:
        raise ValueError("--follow searches the foreground as it lands; run --slides on the stored data")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    options = {"slides": slides, "slide_step": slide_step, "stride": stride, "first_slide": first_slide}
    if method == "cnn":
        if run is None:
            raise ValueError("the CNN search needs --run RUN (a trained gw run)")
        search = SearchConfig(**options, **({"threshold": threshold} if threshold is not None else {}))
        if follow is not None:
            from .follow import follow_cnn

            summary = follow_cnn(run, follow, out, search, idle_timeout=follow_timeout, timing=timing)
        else:
            summary = search_cnn(run, data, out, search, progress=progress, timing=timing)
    else:
        from .mfsearch import FilterConfig, search_matched_filter

        cfg = _population(run, dataset)
        fcfg = FilterConfig(**({"snr_threshold": threshold} if threshold is not None else {}))
        search = SearchConfig(**options)
        if follow is not None:
            from .follow import follow_matched_filter

            summary = follow_matched_filter(cfg, follow, out, search, fcfg, bank, idle_timeout=follow_timeout,
                                            timing=timing)
        else:
            summary = search_matched_filter(cfg, data, out, search, fcfg, bank, cache, timing, progress)
    if background is not None:
        summary = add_far(out, background)
    return summary


def _population(run: Optional[Path], dataset: Optional[int]):
    from ...config import from_dict
    from .config import GWConfig

    if run is not None:
        from ...train.checkpoint import checkpoint_path, load_checkpoint

        config = load_checkpoint(checkpoint_path(Path(run), "best"))["config"]
        return from_dict(GWConfig, config["app_config"], "app")
    if dataset is None:
        raise ValueError("the matched-filter search needs its population: --run RUN or --dataset 1")
    return GWConfig.mlgwsc1(dataset)
