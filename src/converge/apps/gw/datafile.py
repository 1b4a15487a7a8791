"""Continuous multi-detector strain on disk: the MLGWSC-1 layout and GWOSC files, read in chunks.

Two layouts are read, both as a :class:`StrainSet` (the same segments seen by every detector):

- **MLGWSC-1** (``generate_data.py`` of the challenge): one HDF5 file, a group per detector
  (``H1``, ``L1``), in each one dataset per segment named by its integer GPS start, with the
  attributes ``start_time`` [s] and ``delta_t`` [s]. Every detector must hold the same segments.
- **GWOSC** (gwosc.org): one file per detector and stretch (``strain/Strain`` with ``Xspacing``,
  ``meta/GPSstart``, ``meta/Duration``, ``meta/Detector``); files are matched into segments by GPS
  start and duration, and every segment needs a file for every detector.

Nothing is read whole: :meth:`StrainSet.read` returns one detector's samples ``[start, stop)`` of a
segment (an HDF5 hyperslab), so memory stays bounded by the caller's chunk. Gaps (NaN or inf) are
refused with the GPS time of the first bad sample.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import h5py
import numpy as np

from .strainfile import StrainFileError, check_gwosc_layout

SUFFIXES = (".hdf", ".hdf5", ".h5")
RATE_TOLERANCE = 1e-9  # relative: sample rates of two files agree to this or are different rates


@dataclass(frozen=True)
class Segment:
    """A stretch of data every detector holds: ``n_samples`` from GPS ``start`` at ``sample_rate``.

    ``sources`` maps each detector to ``(file, dataset path)``.
    """

    start: float
    n_samples: int
    sample_rate: float
    sources: Mapping[str, tuple[str, str]]

    @property
    def duration(self) -> float:
        return self.n_samples / self.sample_rate

    @property
    def end(self) -> float:
        return self.start + self.duration


@dataclass(frozen=True)
class StrainSet:
    """Segments of strain from ``detectors`` (sorted by GPS start), read on demand."""

    detectors: tuple[str, ...]
    sample_rate: float
    segments: tuple[Segment, ...]
    layout: str  # "mlgwsc1" or "gwosc"

    @property
    def duration(self) -> float:
        """Total seconds of data (per detector)."""
        return float(sum(s.duration for s in self.segments))

    def read(self, segment: int, detector: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Samples ``[start, stop)`` of ``detector`` in segment ``segment``, float64, or converted by HDF5 into
        ``out`` (C-contiguous, of that length and any float type) and returned; NaN/inf refused."""
        seg = self.segments[segment]
        if not 0 <= start <= stop <= seg.n_samples:
            raise ValueError(f"read [{start}, {stop}) outside segment {segment} of {seg.n_samples} samples")
        if out is not None and (out.shape != (stop - start,) or not out.flags.c_contiguous):
            raise ValueError(f"read into an array of shape {out.shape}: give a C-contiguous ({stop - start},) one")
        path, name = seg.sources[detector]
        with h5py.File(path, "r") as f:
            if out is None:
                data = np.asarray(f[name][start:stop], dtype=np.float64)
            else:
                data = out
                if stop > start:
                    f[name].read_direct(data, np.s_[start:stop])
        if len(data) and not (np.isfinite(data.min()) and np.isfinite(data.max())):  # a NaN propagates to both
            bad = ~np.isfinite(data)
            first = seg.start + (start + int(np.flatnonzero(bad)[0])) / seg.sample_rate
            raise StrainFileError(f"{path}: {detector} has {int(bad.sum())} NaN/inf samples (a data gap) in "
                                  f"[{seg.start + start / seg.sample_rate:.3f}, "
                                  f"{seg.start + stop / seg.sample_rate:.3f}), the first at GPS {first:.3f}; "
                                  "cut the data into gap-free segments first")
        return data


def open_strain(paths: str | Path | Sequence[str | Path]) -> StrainSet:
    """The :class:`StrainSet` of one MLGWSC-1 file, or of GWOSC files (paths, or a directory of them)."""
    files = _expand(paths)
    if not files:
        raise StrainFileError(f"{paths}: no HDF5 files ({', '.join(SUFFIXES)}) found")
    kinds = {f: _layout(f) for f in files}
    if any(k == "mlgwsc1" for k in kinds.values()):
        if len(files) > 1:
            raise StrainFileError(f"{len(files)} files given, {sum(k == 'mlgwsc1' for k in kinds.values())} in the "
                                  "MLGWSC-1 layout: give one MLGWSC-1 file (all detectors) or GWOSC files only")
        return _open_mlgwsc1(files[0])
    return _open_gwosc(files)


def _expand(paths: str | Path | Sequence[str | Path]) -> list[Path]:
    items = [paths] if isinstance(paths, (str, Path)) else list(paths)
    files: list[Path] = []
    for item in map(Path, items):
        if item.is_dir():
            files += sorted(p for p in item.iterdir() if p.suffix in SUFFIXES and not p.name.startswith("."))
        elif item.is_file():
            files.append(item)
        else:
            raise StrainFileError(f"{item}: no such file or directory")
    return files


def _layout(path: Path) -> str:
    try:
        f = h5py.File(path, "r")
    except OSError as err:
        raise StrainFileError(f"{path}: not an HDF5 file ({err})") from None
    with f:
        if "strain/Strain" in f:
            return "gwosc"
        groups = [k for k in f if isinstance(f[k], h5py.Group)]
        if groups and all(isinstance(f[g][k], h5py.Dataset) and "start_time" in f[g][k].attrs
                          for g in groups for k in f[g]):
            return "mlgwsc1"
    raise StrainFileError(f"{path}: neither the GWOSC layout (strain/Strain) nor the MLGWSC-1 one (a group per "
                          "detector holding segments with start_time and delta_t attributes)")


def _rate(delta_t: float, where: str) -> float:
    if not delta_t > 0:
        raise StrainFileError(f"{where}: delta_t={delta_t} is not a positive time step")
    return 1.0 / float(delta_t)


def _check_rates(rates: Mapping[str, float], what: str) -> float:
    values = list(rates.values())
    if any(abs(r - values[0]) > RATE_TOLERANCE * values[0] for r in values):
        listing = ", ".join(f"{k} at {r:g} Hz" for k, r in rates.items())
        raise StrainFileError(f"{what}: mismatched sample rates ({listing}); resample to one rate "
                              "(e.g. scipy.signal.resample_poly) before searching")
    return values[0]


def _open_mlgwsc1(path: Path) -> StrainSet:
    entries: dict[str, dict[float, tuple[str, int, float]]] = {}
    with h5py.File(path, "r") as f:
        for det in f:
            entries[det] = {}
            for name, ds in f[det].items():
                if "delta_t" not in ds.attrs:
                    raise StrainFileError(f"{path}: {det}/{name} has no delta_t attribute (seconds per sample)")
                rate = _rate(float(ds.attrs["delta_t"]), f"{path}: {det}/{name}")
                entries[det][float(ds.attrs["start_time"])] = (f"{det}/{name}", int(ds.shape[0]), rate)
    detectors = tuple(sorted(entries))
    starts = sorted(set().union(*(e.keys() for e in entries.values())))
    segments = []
    for start in starts:
        missing = [d for d in detectors if start not in entries[d]]
        if missing:
            have = [d for d in detectors if d not in missing]
            raise StrainFileError(f"{path}: the segment at GPS {start:.0f} is in {', '.join(have)} but not in "
                                  f"{', '.join(missing)}: mismatched detectors")
        lengths = {d: entries[d][start][1] for d in detectors}
        rate = _check_rates({d: entries[d][start][2] for d in detectors}, f"{path}: segment at GPS {start:.0f}")
        if len(set(lengths.values())) != 1:
            raise StrainFileError(f"{path}: the segment at GPS {start:.0f} has {lengths} samples per detector; "
                                  "every detector must cover the same time")
        segments.append(Segment(start, lengths[detectors[0]], rate,
                                {d: (str(path), entries[d][start][0]) for d in detectors}))
    rate = _check_rates({f"segment {s.start:.0f}": s.sample_rate for s in segments}, str(path))
    return StrainSet(detectors, rate, tuple(segments), "mlgwsc1")


def _gwosc_header(path: Path) -> tuple[str, float, int, float]:
    """(detector, GPS start, samples, sample rate) of a GWOSC file."""
    with h5py.File(path, "r") as f:
        dset = check_gwosc_layout(f, path)
        rate = _rate(float(dset.attrs["Xspacing"]), str(path))
        n, gps, duration = int(dset.shape[0]), float(f["meta/GPSstart"][()]), float(f["meta/Duration"][()])
        det = f["meta/Detector"][()] if "meta/Detector" in f else None
    det = det.decode() if isinstance(det, bytes) else det
    if not det:  # GWOSC file names start with the site and detector, e.g. H-H1_GWOSC_4KHZ_R1-1126256640-4096.hdf5
        parts = path.name.split("-")
        det = parts[1].split("_")[0] if len(parts) > 2 else None
    if not det:
        raise StrainFileError(f"{path}: no meta/Detector and no detector in the file name (H-H1_...-GPS-DUR.hdf5)")
    if abs(n / rate - duration) > 1.0 / rate:
        raise StrainFileError(f"{path}: {n} samples at {rate:g} Hz cover {n / rate:g} s, but meta/Duration says "
                              f"{duration:g} s: the file has a gap or is truncated")
    return det, gps, n, rate


def _open_gwosc(files: Iterable[Path]) -> StrainSet:
    by_span: dict[tuple[float, int], dict[str, tuple[Path, float]]] = {}
    for path in files:
        det, gps, n, rate = _gwosc_header(path)
        span = by_span.setdefault((round(gps, 6), n), {})
        if det in span:
            raise StrainFileError(f"{path} and {span[det][0]}: two {det} files for GPS {gps:.0f}")
        span[det] = (path, rate)
    detectors = tuple(sorted(set().union(*by_span.values())))
    segments = []
    for (gps, n), span in sorted(by_span.items()):
        missing = [d for d in detectors if d not in span]
        if missing:
            raise StrainFileError(f"no {', '.join(missing)} file for GPS {gps:.0f} (+{n} samples) that "
                                  f"{', '.join(str(span[d][0]) for d in span)} cover: mismatched detectors; give "
                                  "one file per detector for each stretch, with equal GPS start and duration")
        rate = _check_rates({str(span[d][0]): span[d][1] for d in detectors}, f"GPS {gps:.0f}")
        segments.append(Segment(gps, n, rate, {d: (str(span[d][0]), "strain/Strain") for d in detectors}))
    for a, b in zip(segments, segments[1:]):
        if b.start < a.end - 0.5 / a.sample_rate:
            raise StrainFileError(f"GWOSC files overlap: GPS [{a.start:.0f}, {a.end:.0f}) and [{b.start:.0f}, "
                                  f"{b.end:.0f}); give non-overlapping stretches")
    rate = _check_rates({f"GPS {s.start:.0f}": s.sample_rate for s in segments}, "the GWOSC files")
    return StrainSet(detectors, rate, tuple(segments), "gwosc")


def write_mlgwsc1(path: str | Path, segments: Sequence[tuple[float, Mapping[str, np.ndarray]]],
                  sample_rate: float) -> None:
    """Write segments ``[(gps_start, {detector: samples}), ...]`` in the MLGWSC-1 layout (tests, examples)."""
    with h5py.File(path, "w") as f:
        for start, by_det in segments:
            for det, data in by_det.items():
                ds = f.create_dataset(f"{det}/{int(start)}", data=np.asarray(data, dtype=np.float64))
                ds.attrs["start_time"] = float(start)
                ds.attrs["delta_t"] = 1.0 / sample_rate
        f.attrs["detectors"] = sorted({d for _, by_det in segments for d in by_det})
