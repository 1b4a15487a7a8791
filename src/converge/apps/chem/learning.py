"""The chem app's part of active learning and uncertainty: NMS candidates, DFT labels, spreads.

Candidates are normal-mode-sampled conformers (:func:`~converge.apps.chem.sampling.sample_conformer`
around the GFN2-xTB minimum): cheap to draw by the thousand. A candidate is its
parameters ``{"conformer_seed", "temperature"}``; its geometry is what the app's
simulator draws from them, so labelling one is ``app.simulate`` at that
temperature (checked to give the same geometry). Candidates (the initial set and
the pools) take ``temperatures`` (default the app's and twice it, as the chem
benchmarks' "hot" set) in the proportions ``shares`` (default equal); the test
set (:meth:`ChemLearning.draw_test`) always takes them in equal shares. A cheap
sampler that mostly yields near-equilibrium conformers (shares falling with
temperature) while the surrogate must answer over the whole range is the case
active learning is for: random picks follow the sampler, query by committee
looks for what the sampler rarely makes.

Spreads from an ensemble's served outputs (total energy, hartree; forces, hartree/Å):

- energy: ``sigma_E``, the std over members of the total energy (ddof = 1);
- energy per atom: ``rho = sigma_E / sqrt(N_atoms)``, the query-by-committee score
  of ANI's active learning (Smith et al., J. Chem. Phys. 148, 241733 (2018)). The
  std of the atomic contributions was not used: members split the same total
  among atoms differently (self-energies fitted on each member's own split), so
  their atomic energies disagree even where the totals agree;
- force per atom: ``|sigma_F_i|``, the norm over x, y, z of the per-component std.

For batch diversity a conformer is the vector of its interatomic distances
``r_ij`` (i < j, Å): unchanged by rotation and translation, so two candidates are
close exactly when their shapes are (up to a mirror image).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np
import torch

from ...config import ConfigError
from ...simulate.sample import draw_parameters
from ...units import hartree_to_kcal_mol
from ...validate.active import HeldOut
from ...validate.ensemble import EnsembleModel, EnsemblePrediction
from .config import ChemConfig
from .molecule_set import PAD_SPECIES, modes_of, molecule_set, n_atoms, pad_atoms
from .ood import fit_envelope, save_envelope
from .sampling import SamplingError, sample_conformer

CHEMICAL_ACCURACY_KCAL_MOL = 1.0  # the usual target for an energy error


class ChemSpread(NamedTuple):
    energy: torch.Tensor  # (B,) hartree, ensemble mean of the total energy
    energy_std: torch.Tensor  # (B,) hartree
    energy_std_per_atom: torch.Tensor  # (B,) hartree, sigma_E / sqrt(N_atoms)
    forces: torch.Tensor  # (B, A, 3) hartree/Å, ensemble mean
    force_spread: torch.Tensor  # (B, A) hartree/Å, |std over members| per atom; 0 on padding


def energy_spread_per_atom(energy_std: torch.Tensor, species: torch.Tensor) -> torch.Tensor:
    """``sigma_E / sqrt(N_atoms)``: (B,) from energy std (B,) and species (B, A) (0/-1 padding)."""
    n_atoms = (species > 0).sum(-1).clamp(min=1).to(energy_std.dtype)
    return energy_std / n_atoms.sqrt()


def atom_force_spread(forces_std: torch.Tensor) -> torch.Tensor:
    """Per-atom force spread ``sqrt(sum_xyz std_c^2)``: (B, A, 3) -> (B, A)."""
    return torch.linalg.vector_norm(forces_std, dim=-1)


def interatomic_distances(coordinates: np.ndarray) -> np.ndarray:
    """Distances ``r_ij`` (i < j) of each conformer, Å: (N, A, 3) -> (N, A (A - 1) / 2)."""
    coordinates = np.asarray(coordinates, dtype=np.float64)
    i, j = np.triu_indices(coordinates.shape[1], k=1)
    return np.linalg.norm(coordinates[:, i] - coordinates[:, j], axis=-1)


def share_sequence(shares: Sequence[float], n: int) -> list[int]:
    """``n`` indices into ``shares``, each as often as its share says, spread evenly (smooth weighted
    round robin: every prefix is within one of its quota). Equal shares cycle 0, 1, 2, ..."""
    weights = np.asarray(shares, dtype=np.float64)
    credit, out = np.zeros(len(weights)), []
    for _ in range(n):
        credit += weights
        k = int(np.argmax(np.round(credit, 9)))  # the first of the most owed (rounded: ties stay ties)
        credit[k] -= weights.sum()
        out.append(k)
    return out


def chem_spread(prediction: EnsemblePrediction, species: torch.Tensor | np.ndarray) -> ChemSpread:
    """Means and spreads of an ensemble's chem outputs (``EnsembleModel.predict``)."""
    species = torch.as_tensor(np.asarray(species))
    return ChemSpread(prediction.mean["energy"], prediction.std["energy"],
                      energy_spread_per_atom(prediction.std["energy"], species), prediction.mean["forces"],
                      atom_force_spread(prediction.std["forces"]))


@dataclass(frozen=True)
class ChemLearnConfig:
    """The ``[learn]`` options of chem (``--set learn.temperatures=300,1200 --set learn.shares=3,1``).

    ``temperatures``: conformer temperatures in K (empty: the app's T and 2T); ``shares``: the
    candidate sampler's share of each (initial set and pools; empty: equal). The test set takes
    every temperature alike: the range the surrogate must answer for.
    """

    temperatures: tuple[float, ...] = ()
    shares: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if any(t <= 0 for t in self.temperatures):
            raise ConfigError(f"learn.temperatures={list(self.temperatures)}: give temperatures > 0 K, "
                              "comma-separated, e.g. 150,300,600,1200")
        n = len(self.temperatures) or 2
        if self.shares and (len(self.shares) != n or min(self.shares) <= 0):
            raise ConfigError(f"learn.shares={list(self.shares)}: give one share > 0 per temperature ({n}), "
                              "e.g. 8,4,2,1 for four temperatures")


class ChemLearning:
    """Active learning's view of the chem app (:class:`~converge.validate.active.LearningProblem`)."""

    curve_metrics = ("energy_mae_kcal_mol", "force_mae_kcal_mol_A")

    def __init__(self, app: Any, app_cfg: ChemConfig, temperatures: Sequence[float] | None = None,
                 target_error: float = CHEMICAL_ACCURACY_KCAL_MOL, shares: Sequence[float] | None = None) -> None:
        self.app, self.app_cfg = app, app_cfg
        self.temperatures = tuple(float(t) for t in (temperatures or (app_cfg.temperature, 2 * app_cfg.temperature)))
        if not self.temperatures or min(self.temperatures) <= 0:
            raise ValueError(f"temperatures={self.temperatures}: give one or more temperatures > 0 K")
        self.shares = None if shares is None else tuple(float(w) for w in shares)
        if self.shares is not None and (len(self.shares) != len(self.temperatures) or min(self.shares) <= 0):
            raise ValueError(f"shares={self.shares}: give one share > 0 per temperature {self.temperatures}")
        self.target_error = float(target_error)
        self.molecules = molecule_set(app_cfg)  # one, or a set: a candidate then names its molecule
        self.n_atoms = n_atoms(app_cfg)

    @property
    def settings(self) -> dict[str, Any]:
        out = {"temperatures": list(self.temperatures), "target_error_kcal_mol": self.target_error}
        return out if self.shares is None else {**out, "candidate_shares": list(self.shares)}

    def conformer(self, params: Mapping[str, float]) -> np.ndarray:
        """The candidate's geometry (A, 3) Å of its molecule: the draw ``app.simulate`` makes at its temperature."""
        rng = np.random.default_rng(int(params["conformer_seed"]))
        return sample_conformer(modes_of(self.app_cfg, int(params.get("molecule", 0))), float(params["temperature"]),
                                rng, self.app_cfg.min_distance)

    def draw(self, seed: int, n: int) -> list[dict[str, float]]:
        """``n`` candidates, temperatures in ``shares`` (:func:`share_sequence`); unsampleable draws are skipped."""
        return self._draw(seed, n, self.shares)

    def draw_test(self, seed: int, n: int) -> list[dict[str, float]]:
        """The held-out set: ``n`` conformers, every temperature in equal shares."""
        return self._draw(seed, n, None)

    def _draw(self, seed: int, n: int, shares: Sequence[float] | None) -> list[dict[str, float]]:
        order = share_sequence(shares or [1.0] * len(self.temperatures), n)
        out: list[dict[str, float]] = []
        index = 0
        while len(out) < n:
            if index >= 10 * n + 100:
                raise SamplingError(f"fewer than {n} of {index} NMS draws gave a valid conformer; "
                                    f"lower the temperatures {self.temperatures} or app.min_distance")
            params = {**draw_parameters(self.app, self.app_cfg, seed, index),
                      "temperature": self.temperatures[order[len(out)]]}
            index += 1
            try:
                self.conformer(params)
            except SamplingError:
                continue
            out.append(params)
        return out

    def inputs(self, params: Sequence[Mapping[str, float]]) -> dict[str, np.ndarray]:
        """Species (N, A) and coordinates (N, A, 3) Å of the candidates, padded to the set's atom count."""
        species = [self.molecules[int(p.get("molecule", 0))].atomic_numbers for p in params]
        return {"species": np.stack([pad_atoms(z, self.n_atoms, PAD_SPECIES) for z in species]),
                "coordinates": np.stack([pad_atoms(self.conformer(p), self.n_atoms, 0.0) for p in params])}

    def label(self, params: Mapping[str, float]) -> dict[str, np.ndarray]:
        """DFT through the app's simulator at the candidate's temperature."""
        cfg = replace(self.app_cfg, temperature=float(params["temperature"]))
        arrays = self.app.simulate(cfg, {k: v for k, v in params.items() if k in ("molecule", "conformer_seed")})
        expected = pad_atoms(self.conformer(params), self.n_atoms, 0.0)
        if not np.allclose(arrays["coordinates"], expected, atol=1e-10):
            raise RuntimeError("the simulator drew another geometry than the candidate's: ChemLearning.conformer "
                               "no longer matches ChemApp.simulate")
        return arrays

    def disagreement(self, prediction: EnsemblePrediction, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        """``sigma_E / sqrt(N_atoms)`` in kcal/mol per candidate."""
        species = torch.as_tensor(np.asarray(inputs["species"]))
        return hartree_to_kcal_mol(energy_spread_per_atom(prediction.std["energy"], species).numpy())

    def descriptors(self, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        """Interatomic distances (N, A (A - 1) / 2) Å: alike conformers are close (batch diversity)."""
        return interatomic_distances(inputs["coordinates"])

    def held_out(self, ensemble: EnsembleModel, arrays: Mapping[str, np.ndarray],
                 params: Mapping[str, np.ndarray]) -> HeldOut:
        """Energy and force errors of the ensemble mean, and the mean spreads (kcal/mol, kcal/mol/Å)."""
        prediction = ensemble.predict({"species": arrays["species"], "coordinates": arrays["coordinates"]})
        spread = chem_spread(prediction, arrays["species"])
        energy_error = hartree_to_kcal_mol(spread.energy.numpy() - arrays["energy"])  # (N,)
        real = np.asarray(arrays["species"]) > 0  # (N, A): padding atoms carry no force
        force_error = hartree_to_kcal_mol(spread.forces.numpy() - arrays["forces"])[real]  # (M, 3), real atoms
        energy_std = hartree_to_kcal_mol(spread.energy_std.numpy())
        metrics: dict[str, Any] = {
            "n_test": len(energy_error),
            "energy_mae_kcal_mol": float(np.mean(np.abs(energy_error))),
            "energy_rmse_kcal_mol": float(np.sqrt(np.mean(energy_error**2))),
            "force_mae_kcal_mol_A": float(np.mean(np.abs(force_error))),
            "mean_energy_spread_kcal_mol": float(np.mean(energy_std)),
            "mean_energy_spread_per_atom_kcal_mol": float(np.mean(hartree_to_kcal_mol(
                spread.energy_std_per_atom.numpy()))),
            "mean_force_spread_kcal_mol_A": float(np.mean(hartree_to_kcal_mol(spread.force_spread.numpy()))),
        }
        if "molecule" in arrays:
            from .evaluate import relative_energy_mae

            metrics["relative_energy_mae_kcal_mol"] = relative_energy_mae(spread.energy.numpy(), arrays["energy"],
                                                                          arrays["molecule"])
        if "temperature" in params:
            metrics["energy_mae_by_temperature"] = {
                f"{t:g}": float(np.mean(np.abs(energy_error[params["temperature"] == t])))
                for t in np.unique(params["temperature"])}
        return HeldOut(metrics, energy_std, energy_error, "energy", "kcal/mol")

    def after_training(self, ensemble_dir: Path, arrays: Mapping[str, np.ndarray]) -> None:
        """The training set's envelope (``ood.json``), for :func:`~converge.apps.chem.ood.check_in_distribution`."""
        save_envelope(ensemble_dir, fit_envelope(arrays["species"], arrays["coordinates"]))
