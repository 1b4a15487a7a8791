"""Out-of-distribution check for the chem surrogate: is a structure like those it was trained on?

A network potential is only trained where its data are. From the training
conformers (``species`` (N, A) atomic numbers, 0 or -1 padding; ``coordinates``
(N, A, 3) Å) :func:`fit_envelope` records

- the elements seen;
- per element pair, the shortest interatomic distance seen (Å);
- per element, the largest nearest-neighbour distance seen (Å): a stretched or
  broken bond lies beyond it;
- per element, the range of neighbour counts within ``cutoff`` (Å; default the
  ANI-1x radial AEV cutoff 5.2 Å, the range an atom's features see): a larger or
  smaller molecule, or a crowded environment, falls outside it.

:func:`check_in_distribution` returns the reasons a structure falls outside
(distances with a ``margin`` in Å); an empty list means in distribution. It never
answers silently: serving calls it to refuse a structure or route it to a
fallback (DFT). The envelope is stored with the run as ``ood.json``.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...data.atomic import atomic_write_bytes, json_bytes

ENVELOPE_FILE = "ood.json"
NEIGHBOUR_CUTOFF = 5.2  # Å, ANI-1x radial AEV cutoff R_cr: an atom sees no farther
DISTANCE_MARGIN = 0.05  # Å: tolerance on the training extremes before a distance counts as new
SYMBOLS = {1: "H", 6: "C", 7: "N", 8: "O", 9: "F", 16: "S", 17: "Cl"}


def _symbol(z: int) -> str:
    return SYMBOLS.get(int(z), f"Z{int(z)}")


def pair_key(z1: int, z2: int) -> str:
    """``"1-8"``: the element pair, lower atomic number first."""
    a, b = sorted((int(z1), int(z2)))
    return f"{a}-{b}"


@dataclass(frozen=True)
class TrainingEnvelope:
    """What the training conformers covered (module docstring); distances in Å."""

    elements: tuple[int, ...]
    pair_min_distance: dict[str, float]  # pair_key -> shortest distance seen
    nearest_max: dict[str, float]  # str(Z) -> largest nearest-neighbour distance seen
    neighbour_count: dict[str, tuple[int, int]]  # str(Z) -> (fewest, most) neighbours within cutoff
    cutoff: float = NEIGHBOUR_CUTOFF
    margin: float = DISTANCE_MARGIN
    n_conformers: int = 0
    notes: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainingEnvelope:
        return cls(elements=tuple(data["elements"]), pair_min_distance=dict(data["pair_min_distance"]),
                   nearest_max=dict(data["nearest_max"]),
                   neighbour_count={k: (int(v[0]), int(v[1])) for k, v in data["neighbour_count"].items()},
                   cutoff=float(data["cutoff"]), margin=float(data["margin"]),
                   n_conformers=int(data["n_conformers"]), notes=dict(data.get("notes", {})))


def _distances(species: np.ndarray, coordinates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Interatomic distances (N, A, A) Å, inf on the diagonal and for padding atoms; and the real-atom mask."""
    real = species > 0  # (N, A)
    d = np.linalg.norm(coordinates[:, :, None, :] - coordinates[:, None, :, :], axis=-1)  # (N, A, A)
    pair = real[:, :, None] & real[:, None, :] & ~np.eye(species.shape[1], dtype=bool)
    return np.where(pair, d, np.inf), real


def _check_shapes(species: np.ndarray, coordinates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    species = np.asarray(species, dtype=np.int64)
    coordinates = np.asarray(coordinates, dtype=np.float64)
    if species.ndim == 1:
        species, coordinates = species[None], coordinates[None]
    if species.ndim != 2 or coordinates.shape != (*species.shape, 3):
        raise ValueError(f"species must be (N, A) or (A,) and coordinates (N, A, 3) or (A, 3); got "
                         f"{species.shape} and {coordinates.shape}")
    return species, coordinates


def fit_envelope(species: np.ndarray, coordinates: np.ndarray, cutoff: float = NEIGHBOUR_CUTOFF,
                 margin: float = DISTANCE_MARGIN) -> TrainingEnvelope:
    """The envelope of training conformers: species (N, A), coordinates (N, A, 3) Å."""
    species, coordinates = _check_shapes(species, coordinates)
    if not np.all(np.isfinite(coordinates)):
        raise ValueError("training coordinates hold NaN or inf")
    d, real = _distances(species, coordinates)
    elements = tuple(sorted(int(z) for z in np.unique(species[real])))
    if not elements:
        raise ValueError("no atoms in the training conformers (all species are padding)")
    pair_min: dict[str, float] = {}
    for i, za in enumerate(elements):
        for zb in elements[i:]:
            mask = (species[:, :, None] == za) & (species[:, None, :] == zb)
            smallest = float(np.min(d[mask], initial=np.inf))
            if np.isfinite(smallest):
                pair_min[pair_key(za, zb)] = smallest
    nearest = d.min(axis=-1)  # (N, A), inf for padding and lone atoms
    counts = (d < cutoff).sum(axis=-1)  # (N, A)
    nearest_max, count_range = {}, {}
    for z in elements:
        atoms = species == z
        finite = nearest[atoms][np.isfinite(nearest[atoms])]
        if finite.size:
            nearest_max[str(z)] = float(finite.max())
        count_range[str(z)] = (int(counts[atoms].min()), int(counts[atoms].max()))
    return TrainingEnvelope(elements, pair_min, nearest_max, count_range, float(cutoff), float(margin),
                            int(species.shape[0]))


def check_in_distribution(envelope: TrainingEnvelope, species: np.ndarray, coordinates: np.ndarray) -> list[str]:
    """Reasons one structure (species (A,), coordinates (A, 3) Å) is outside the envelope; [] if inside."""
    species, coordinates = _check_shapes(species, coordinates)
    if species.shape[0] != 1:
        raise ValueError(f"check one structure at a time (got {species.shape[0]}); use check_batch for many")
    species, coordinates = species[:1], coordinates[:1]
    real = species[0] > 0
    if not real.any():
        return ["no atoms: every species entry is padding (0 or -1)"]
    if not np.all(np.isfinite(coordinates[0][real])):
        return ["coordinates hold NaN or inf"]
    reasons = []
    known = np.isin(species[0], envelope.elements) | ~real
    for z in sorted(set(species[0][~known].tolist())):
        atoms = ", ".join(str(k + 1) for k in np.flatnonzero(species[0] == z))
        trained = ", ".join(_symbol(e) for e in envelope.elements)
        reasons.append(f"element {_symbol(z)} (atoms {atoms}) never seen in training; trained on {trained}")
    d, _ = _distances(species, coordinates)
    d, z = d[0], species[0]
    checked = known & real
    reasons += _pair_reasons(envelope, z, d, checked) + _atom_reasons(envelope, z, d, checked)
    return reasons


def _pair_reasons(envelope: TrainingEnvelope, z: np.ndarray, d: np.ndarray, checked: np.ndarray) -> list[str]:
    reasons = []
    elements = sorted(set(z[checked].tolist()))
    for i, za in enumerate(elements):
        for zb in elements[i:]:
            mask = (z[:, None] == za) & (z[None, :] == zb) & checked[:, None] & checked[None, :]
            if not np.isfinite(np.min(d[mask], initial=np.inf)):
                continue
            a, b = np.unravel_index(np.argmin(np.where(mask, d, np.inf)), d.shape)
            a, b = min(a, b), max(a, b)
            label = f"{_symbol(z[a])}-{_symbol(z[b])}"
            shortest = envelope.pair_min_distance.get(pair_key(za, zb))
            if shortest is None and d[a, b] < envelope.cutoff:
                reasons.append(f"atoms {a + 1} and {b + 1} form a {label} pair {d[a, b]:.3f} Å apart; training "
                               f"never had a {label} pair within {envelope.cutoff} Å")
            elif shortest is not None and d[a, b] < shortest - envelope.margin:
                reasons.append(f"atoms {a + 1} and {b + 1} ({label}) are {d[a, b]:.3f} Å apart, shorter than the "
                               f"training minimum {shortest:.3f} Å by more than {envelope.margin} Å")
    return reasons


def _atom_reasons(envelope: TrainingEnvelope, z: np.ndarray, d: np.ndarray, checked: np.ndarray) -> list[str]:
    reasons = []
    nearest = d.min(axis=-1)
    counts = (d < envelope.cutoff).sum(axis=-1)
    for element in sorted(set(z[checked].tolist())):
        atoms = np.flatnonzero((z == element) & checked)
        farthest = atoms[np.argmax(nearest[atoms])]
        limit = envelope.nearest_max.get(str(element))
        if limit is not None and np.isfinite(nearest[farthest]) and nearest[farthest] > limit + envelope.margin:
            reasons.append(f"atom {farthest + 1} ({_symbol(element)}) has its nearest neighbour "
                           f"{nearest[farthest]:.3f} Å away, beyond the training maximum {limit:.3f} Å "
                           f"(a stretched or broken bond)")
        low, high = envelope.neighbour_count[str(element)]
        outside = atoms[(counts[atoms] < low) | (counts[atoms] > high)]
        if outside.size:
            k = outside[0]
            reasons.append(f"atom {k + 1} ({_symbol(element)}) has {counts[k]} neighbours within "
                           f"{envelope.cutoff} Å; training had {low} to {high}")
    return reasons


def inside_envelope(envelope: TrainingEnvelope, species: np.ndarray, coordinates: np.ndarray) -> np.ndarray:
    """(B,) bool: which of (B, A) species and (B, A, 3) coordinates Å lie inside the envelope, all at once.

    The same tests as :func:`check_in_distribution` without the messages: every atom of a trained element,
    finite coordinates, no pair closer than its training minimum less the margin (nor an untrained pair within
    the cutoff), no nearest neighbour beyond the training maximum plus the margin, neighbour counts within the
    training range. One pass of array operations over the batch: the server runs it on every request.
    """
    species, coordinates = _check_shapes(species, coordinates)
    real = species > 0
    elements = np.asarray(envelope.elements, dtype=np.int64)
    z = np.where(real, species, 0)
    index = np.full(max(int(z.max(initial=0)), int(elements.max(initial=0))) + 1, len(elements))  # Z -> row
    index[elements] = np.arange(len(elements))
    k = index[z]  # (B, A): the element's row, len(elements) for padding and untrained elements
    ok = real.any(axis=1) & ~((k == len(elements)) & real).any(axis=1)
    ok &= np.where(real[..., None], np.isfinite(coordinates), True).all(axis=(1, 2))
    d, _ = _distances(species, np.where(real[..., None], np.nan_to_num(coordinates), 0.0))  # (B, A, A)
    n = len(elements) + 1  # thresholds per element pair; the last row and column (padding) never fail
    closest = np.full((n, n), -np.inf)
    for i, za in enumerate(elements):
        for j, zb in enumerate(elements):
            shortest = envelope.pair_min_distance.get(pair_key(za, zb))
            closest[i, j] = envelope.cutoff if shortest is None else shortest - envelope.margin
    ok &= ~(d < closest[k[:, :, None], k[:, None, :]]).any(axis=(1, 2))
    farthest = np.full(n, np.inf)
    for i, element in enumerate(elements):
        limit = envelope.nearest_max.get(str(element))
        farthest[i] = np.inf if limit is None else limit + envelope.margin
    nearest = d.min(axis=-1)  # (B, A)
    stretched = np.isfinite(nearest) & (nearest > farthest[k])
    return ok & ~(stretched | _counts_outside(envelope, species, d)).any(axis=1)


def _counts_outside(envelope: TrainingEnvelope, species: np.ndarray, d: np.ndarray) -> np.ndarray:
    """(B, A) bool: atoms of a trained element whose neighbour count within the envelope's cutoff (``d`` (B, A, A)
    distances, inf for padding) lies outside the range that element had in training."""
    counts = (d < envelope.cutoff).sum(axis=-1)  # (B, A)
    outside = np.zeros(species.shape, dtype=bool)
    for element, (low, high) in envelope.neighbour_count.items():
        outside |= (species == int(element)) & ((counts < low) | (counts > high))
    return outside


def atoms_outside_neighbour_counts(envelope: TrainingEnvelope, species: np.ndarray,
                                   coordinates: np.ndarray) -> np.ndarray:
    """(B, A) bool: which atoms of (B, A) species and (B, A, 3) coordinates Å have more (or fewer) neighbours within
    the envelope's cutoff than any atom of their element in training: features the network extrapolates to."""
    species, coordinates = _check_shapes(species, coordinates)
    d, _ = _distances(species, coordinates)
    return _counts_outside(envelope, species, d)


def check_batch(envelope: TrainingEnvelope, species: np.ndarray, coordinates: np.ndarray) -> list[list[str]]:
    """:func:`check_in_distribution` for each of (B, A) species and (B, A, 3) coordinates: the batch is tested
    at once (:func:`inside_envelope`) and only the structures outside are checked one by one for their reasons."""
    species, coordinates = _check_shapes(species, coordinates)
    inside = inside_envelope(envelope, species, coordinates)
    return [[] if fine else check_in_distribution(envelope, s, c)
            for fine, s, c in zip(inside, species, coordinates)]


def save_envelope(run_dir: str | Path, envelope: TrainingEnvelope) -> Path:
    """``run_dir/ood.json``, written atomically."""
    path = Path(run_dir) / ENVELOPE_FILE
    atomic_write_bytes(path, json_bytes(envelope.to_dict()))
    return path


def load_envelope(run_dir: str | Path) -> TrainingEnvelope:
    path = Path(run_dir) / ENVELOPE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: record the training envelope with fit_envelope and "
                                "save_envelope when the model is trained")
    return TrainingEnvelope.from_dict(json.loads(path.read_text()))
