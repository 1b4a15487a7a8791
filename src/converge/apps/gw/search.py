"""``converge search gw``: a trained coherent CNN slid along continuous multi-detector strain.

Stages, all in bounded memory:

1. read the data (:mod:`.datafile`: the MLGWSC-1 layout or GWOSC files), check that it holds the
   run's detectors at the run's sample rate in segments long enough to whiten;
2. whiten each detector of each segment with its own Welch PSD (:mod:`.conditioning`, in float32) into a
   float32 memmap in a work folder, ``chunk_s`` seconds at a time (removed afterwards);
3. score windows of ``cfg.window`` s every ``stride`` s, all detectors stacked as channels
   (``(B, D, N)``); for time slide ``k`` (:mod:`.slides`) the second and later detectors are
   read shifted by ``k`` steps (slide 0 is the foreground);
4. cluster: windows with logit above ``threshold`` closer than ``cluster_s`` join one event, of
   ``stat`` its largest logit and ``time`` the mean start of its windows scoring above the midpoint
   of threshold and peak, plus the middle of the trained merger range, minus the run's measured
   timing bias; ``var`` is the run's measured tolerance (:mod:`.timing`), else :func:`default_var`;
5. write the events atomically (:mod:`.events`) and ``OUT.json``, the summary.
"""
from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ...data.atomic import atomic_write_bytes, json_bytes
from .conditioning import Conditioning, WhitenedSegment, whiten_strain_set
from .config import GWConfig
from .datafile import StrainSet, open_strain
from .events import cluster_in_time, write_events
from .model import STRIDE
from .slides import background_seconds, check_slide_step, slid_index, slide_shifts
from .strainfile import StrainFileError


@dataclass(frozen=True)
class SearchConfig:
    """Settings of ``converge search gw`` shared by the CNN and the matched-filter search."""

    stride: float = 0.125  # s between CNN windows
    threshold: float = 0.0  # CNN logit a window needs to join an event (0: probability 1/2)
    cluster_s: float = 1.0  # windows (or coincidences) closer than this are one event
    slides: int = 0  # 0: the foreground (zero lag); N: the background of slides first_slide .. first_slide + N - 1
    slide_step: float = 2.0  # s
    first_slide: int = 1
    batch_size: int = 1024  # CNN windows per pass: a streamed pass recomputes a window's worth (0.8%; 3% at 256)
    f_lower: float = 20.0
    chunk_s: float = 256.0
    # CNN inference. fp32: with each BatchNorm folded into its convolution (DetectionCNN.for_inference) bf16
    # autocast is no faster on a Zen 4 core (its max-pooling costs 3x fp32's) and rounds the features to 3 digits;
    # "auto" is the app's bf16 where the CPU has bf16 units (the head stays fp32 either way)
    precision: str = "fp32"

    def __post_init__(self) -> None:
        if not self.stride > 0 or not self.cluster_s > 0:
            raise ValueError(f"stride={self.stride}, cluster_s={self.cluster_s}: both must be positive seconds")
        if self.slides < 0:
            raise ValueError(f"slides={self.slides}: give 0 (foreground) or a positive number of time slides")

    @property
    def conditioning(self) -> Conditioning:
        return Conditioning(f_lower=self.f_lower, chunk_s=self.chunk_s)


def default_var(cfg: GWConfig, search: SearchConfig) -> float:
    """Time tolerance [s] before any measurement: half the trained merger range plus one stride (a merger
    anywhere in the range of the windows that fire, each window start on a stride grid)."""
    return 0.5 * (cfg.merger_max - cfg.merger_min) + search.stride


def check_data(data: StrainSet, detectors: tuple[str, ...], sample_rate: float, min_segment_s: float,
               what: str) -> None:
    """Refuse data without the wanted detectors, at another sample rate, or with too short segments."""
    missing = [d for d in detectors if d not in data.detectors]
    if missing:
        raise StrainFileError(f"{what} needs detectors {', '.join(detectors)}, but the data holds "
                              f"{', '.join(data.detectors)}: mismatched detectors")
    if abs(data.sample_rate - sample_rate) > 1e-6 * sample_rate:
        raise StrainFileError(f"the data is sampled at {data.sample_rate:g} Hz but {what} works at {sample_rate:g} Hz; "
                              "resample it (scipy.signal.resample_poly) or use a run trained at that rate")
    short = [s for s in data.segments if s.duration < min_segment_s]
    if short:
        raise StrainFileError(f"segment at GPS {short[0].start:.0f} lasts {short[0].duration:g} s, shorter than the "
                              f"{min_segment_s:g} s needed to estimate a PSD and whiten; {len(short)} such segment(s)")


def stretch(seg: WhitenedSegment, detectors: tuple[str, ...], first: int, end: int, shift: int) -> torch.Tensor:
    """The strain ``(D, end - first)`` of first-detector samples ``first:end``; the other detectors are read at
    the slide's shifted samples (:func:`.slides.slid_index`)."""
    span = np.arange(first, end)
    rows = []
    for k, det in enumerate(detectors):
        x = seg.channels[det][first:end] if (k == 0 or shift == 0) else seg.channels[det][
            slid_index(span, seg.valid, k * shift)]
        rows.append(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)))
    return torch.stack(rows)  # (D, T)


def window_batch(seg: WhitenedSegment, detectors: tuple[str, ...], starts: np.ndarray, n: int,
                 shift: int) -> torch.Tensor:
    """Windows ``(B, D, n)`` starting at first-detector samples ``starts`` (contiguous, equally spaced), as
    :func:`stretch` reads them."""
    step = int(starts[1] - starts[0]) if len(starts) > 1 else 1
    return stretch(seg, detectors, int(starts[0]), int(starts[-1]) + n, shift).unfold(1, n, step).transpose(0, 1)


def score_segment(model: torch.nn.Module, cfg: GWConfig, seg: WhitenedSegment, search: SearchConfig,
                  shift: int, progress: Callable[[int], None] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(window start samples, logits) of every window in the segment's valid range for one slide; a streamable
    network (``conv_padding="valid"``) scores each batch's windows from one pass over their stretch."""
    n, step = cfg.window_samples, max(1, int(round(search.stride * seg.sample_rate)))
    starts = np.arange(seg.valid[0], seg.valid[1] - n + 1, step)
    logits = np.empty(len(starts), dtype=np.float32)
    detectors = cfg.network
    streaming = getattr(model, "streamable", False) and step % STRIDE == 0
    with torch.inference_mode(), inference_precision(search.precision):
        for i in range(0, len(starts), search.batch_size):
            chunk = starts[i:i + search.batch_size]
            if streaming:
                x = stretch(seg, detectors, int(chunk[0]), int(chunk[-1]) + n, shift)
                out = model.stream(x if cfg.coherent else x[0], step)
            else:
                x = window_batch(seg, detectors, chunk, n, shift)
                out = model(x if cfg.coherent else x[:, 0])
            logits[i:i + len(chunk)] = out.float().numpy()
            if progress is not None:
                progress(len(chunk) * step)
    return starts, logits


def inference_precision(precision: str):
    """The autocast context of CNN inference (``auto``: the app's default where the CPU runs it natively)."""
    from ...train.loop import autocast_context
    from ...train.precision import resolve_precision
    from .app import GWApp

    device = torch.device("cpu")
    return autocast_context(device, resolve_precision(precision, GWApp.default_precision, device))


def windows_to_events(starts_s: np.ndarray, logits: np.ndarray, threshold: float, gap: float,
                      merger_offset: float) -> tuple[np.ndarray, np.ndarray]:
    """(times, stats) of the events: above-threshold windows clustered by start time (module doc, step 4)."""
    above = logits > threshold
    t, z = starts_s[above], logits[above]
    labels = cluster_in_time(t, z, gap)
    n = int(labels[-1]) + 1 if len(labels) else 0
    peak = np.full(n, -np.inf)
    np.maximum.at(peak, labels, z)
    top = z >= 0.5 * (peak[labels] + threshold)
    count = np.bincount(labels[top], minlength=n)
    mean_start = np.bincount(labels[top], weights=t[top], minlength=n) / np.maximum(count, 1)
    return mean_start + merger_offset, peak


def search_cnn(run_dir: Path, data_paths: Any, out: Path, search: SearchConfig = SearchConfig(),
               progress: bool = True, work_dir: Path | None = None, timing: Path | None = None) -> dict[str, Any]:
    """Run the CNN search (module docstring); writes ``out`` and ``out.json``, returns the summary."""
    from ...config import from_dict
    from ...train.loop import load_model
    from .app import GWApp
    from .timing import read_timing

    t0 = time.perf_counter()
    model, config = load_model(GWApp(), Path(run_dir))
    model = model.for_inference(copy_model=False)  # loaded for this search alone
    cfg = from_dict(GWConfig, config["app_config"], "app")
    data = open_strain(data_paths)
    # the network takes float32 (the whitened strain is stored so): the conditioning computes in it, at half the
    # cost of float64; the matched filter's stays float64, as its full-day figures were made (README)
    cond = replace(search.conditioning, dtype="float32")
    check_data(data, cfg.network, cfg.sample_rate, cond.min_segment_s(cfg.window), f"the run {run_dir}")
    if search.slides:
        if len(cfg.network) != 2:
            raise StrainFileError(f"time slides shift one detector against another: they need two, and the run "
                                  f"sees {', '.join(cfg.network)}")
        check_slide_step(search.slide_step, cfg.window)
    measured = read_timing(Path(timing) if timing else Path(run_dir))
    offset = measured["offset_s"] if measured else 0.0
    var = measured["var_s"] if measured else default_var(cfg, search)
    merger_offset = 0.5 * (cfg.merger_min + cfg.merger_max) - offset
    work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix=".search-", dir=Path(out).parent))
    bar = _Bar(progress, data.duration * (len(cfg.network) + max(search.slides, 1)), "search")
    columns: dict[str, list[np.ndarray]] = {"time": [], "stat": [], "slide": []}
    try:
        segments = whiten_strain_set(data, cond, work, cfg.network, bar.advance_samples(data.sample_rate))
        t_whitened = time.perf_counter()
        valid_s = sum(s.n_valid for s in segments) / data.sample_rate
        step = int(round(search.slide_step * data.sample_rate))
        for seg in segments:
            slides = slide_shifts(search.slides, step, seg.n_valid, search.first_slide) if search.slides else \
                np.zeros(1, np.int64)
            for k, shift in enumerate(slides):
                starts, logits = score_segment(model, cfg, seg, search, int(shift),
                                               bar.advance_samples(data.sample_rate))
                times, stats = windows_to_events(seg.start + starts / seg.sample_rate, logits, search.threshold,
                                                 search.cluster_s, merger_offset)
                columns["time"].append(times)
                columns["stat"].append(stats)
                columns["slide"].append(np.full(len(times), k + search.first_slide if search.slides else 0))
    finally:
        bar.stop()
        if work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    cat = {k: np.concatenate(v) if v else np.zeros(0) for k, v in columns.items()}
    cat["var"] = np.full(len(cat["time"]), var)
    seconds = time.perf_counter() - t0
    summary = _summary("cnn", search, data, valid_s, cat, seconds, t_whitened - t0, {
        "run": str(run_dir), "window_s": cfg.window, "detectors": list(cfg.network), "var_s": var,
        "timing_offset_s": offset, "timing_measured": bool(measured), "data_paths": str(data_paths)})
    write_events(out, cat, {k: v for k, v in summary.items() if isinstance(v, (int, float, str))})
    atomic_write_bytes(Path(out).with_suffix(".json"), json_bytes(summary))
    return summary


def _summary(method: str, search: SearchConfig, data: StrainSet, valid_s: float, cat: dict, seconds: float,
             conditioning_s: float, extra: dict) -> dict[str, Any]:
    n_slides = search.slides
    return {"method": method, "kind": "background" if n_slides else "foreground",
            "layout": data.layout, "n_segments": len(data.segments), "detectors_in_data": list(data.detectors),
            "gps_start": data.segments[0].start, "gps_end": data.segments[-1].end,
            "duration_s": data.duration, "analysed_s": valid_s,
            "background_s": background_seconds(n_slides, valid_s) if n_slides else 0.0,
            "slides": n_slides, "first_slide": search.first_slide if n_slides else 0,
            "slide_step_s": search.slide_step, "n_events": int(len(cat["time"])),
            "seconds": seconds, "conditioning_seconds": conditioning_s,
            "seconds_per_strain_second": seconds / max(data.duration * max(n_slides, 1), 1e-9),
            "threads": torch.get_num_threads(), "search_config": asdict(search), **extra}


class _Bar:
    """A rich progress bar over strain seconds, or nothing."""

    def __init__(self, enabled: bool, total_s: float, what: str) -> None:
        self.bar = None
        if enabled:
            from rich.progress import Progress

            self.bar = Progress()
            self.task = self.bar.add_task(f"{what}: strain seconds", total=total_s)
            self.bar.start()

    def advance_samples(self, sample_rate: float) -> Callable[[int], None] | None:
        if self.bar is None:
            return None
        return lambda n: self.bar.update(self.task, advance=n / sample_rate)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def add_far(events_path: Path, background_path: Path) -> dict[str, Any]:
    """Give each event of ``events_path`` its FAR per month and per year from the background events of a
    ``--slides`` run (:func:`.slides.far_table`); rewrites the events file and its summary atomically."""
    from .events import read_events
    from .slides import far_table

    columns, attrs = read_events(events_path)
    bg, bg_attrs = read_events(background_path)
    background_s = float(bg_attrs.get("background_s", 0.0))
    if not background_s > 0:
        raise ValueError(f"{background_path} records no background duration: make it with --slides N")
    if bg_attrs.get("method") != attrs.get("method"):
        raise ValueError(f"{background_path} comes from the {bg_attrs.get('method')} search, {events_path} from "
                         f"the {attrs.get('method')} one: rank events against their own method's background")
    columns.update(far_table(columns["stat"], bg["stat"], background_s))
    attrs.update({"far_background_s": background_s, "far_background_file": str(background_path)})
    write_events(events_path, columns, attrs)
    summary_path = Path(events_path).with_suffix(".json")
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else dict(attrs)
    loudest = np.argsort(-columns["stat"])[:10]
    summary.update({"far_background_s": background_s, "far_background_file": str(background_path),
                    "loudest": [{"time": float(columns["time"][i]), "stat": float(columns["stat"][i]),
                                 "far_per_month": float(columns["far_per_month"][i]),
                                 "far_per_year": float(columns["far_per_year"][i])} for i in loudest]})
    atomic_write_bytes(summary_path, json_bytes(summary))
    return summary
