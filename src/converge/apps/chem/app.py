"""The chem app: an ANI-style neural network potential trained on DFT.

Simulator: one conformer per task, drawn by normal-mode sampling around the
optimised geometry of ``cfg.molecule``, labelled with a KS-DFT energy and
analytic forces from PySCF at ``cfg.level``. Surrogate: ANI-1x atomic
environment vectors and one MLP per element (``model.py``); forces are -dE/dr by
autograd. Loss: energies and forces in kcal/mol, forces weighted by
``cfg.force_weight``.
"""
from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from ...data.sources import ArraySource, split_indices
from ...units import hartree_to_kcal_mol
from ...contract import App, ArraySpec, BatchSource, Monitor, TensorSpec
from .config import ChemConfig
from .delta import baseline_energies_forces
from .dft import dft_energy_forces
from .model import (ELEMENTS, ANIPotential, EnergiesForces, element_counts, fit_energy_scale, fit_self_energies,
                    from_config)
from .molecule_set import (PAD_SPECIES, is_multi, modes_of, molecule_set, n_atoms, pad_atoms,
                           padded_energies_forces)
from .molecules import get_molecule
from .sampling import sample_conformer


def network_energies_forces(model: ANIPotential, species: torch.Tensor, coordinates: torch.Tensor,
                            create_graph: bool) -> EnergiesForces:
    """Energy minus the self-energies (B,) and forces (B, A, 3), hartree and hartree/Å.

    The self-energies are constant in the coordinates, so the forces are those of
    the full potential; leaving them out keeps float32 precise (a total energy of
    -155 Ha in float32 carries only ~1e-5 Ha).
    """
    with torch.inference_mode(False), torch.enable_grad():
        coords = coordinates.detach().clone().requires_grad_(True)  # clone: leave inference tensors behind
        energy = model.network_energy(species.clone(), coords)
        (gradient,) = torch.autograd.grad(energy.sum(), coords, create_graph=create_graph)
    if not create_graph:
        energy = energy.detach()
    return EnergiesForces(energy, -gradient)


def outside_envelope(envelope: Any, inputs: Mapping[str, np.ndarray]) -> list[list[str]]:
    """Per served sample, the reasons it lies outside the training envelope ([] when inside)."""
    from .ood import check_batch

    return check_batch(envelope, inputs["species"], inputs["coordinates"])


def training_self_energies(species: torch.Tensor, energy: torch.Tensor) -> dict[int, float]:
    """Per-element self-energies fitted on the training set, rounded to float32.

    Rounded so the residual targets use exactly the values a float32 model holds.
    """
    fitted = fit_self_energies(species, energy)
    return {z: float(np.float32(v)) for z, v in fitted.items()}


class ChemApp(App):
    name = "chem"
    config_cls = ChemConfig
    monitor = Monitor("energy_mae_kcal_mol", "min")
    packages = ("pyscf", "torchani", "tblite", "ase")
    grad_at_inference = True
    default_precision = "fp32"  # AEV and energy sums need fp32; bf16 costs accuracy (README)
    train_defaults = {"epochs": 300, "batch_size": 16, "lr": 1e-3}  # benchmarks/chem_full.py's, the README's figures

    @property
    def evaluate_config_cls(self) -> type:  # type: ignore[override]
        from .evaluate import ChemEvalConfig

        return ChemEvalConfig

    @property
    def learn_config_cls(self) -> type:  # type: ignore[override]
        from .learning import ChemLearnConfig

        return ChemLearnConfig

    def learning_problem(self, cfg: ChemConfig, options: Any = None) -> Any:
        """Normal-mode conformers at ``options.temperatures`` labelled by DFT (:class:`.learning.ChemLearning`)."""
        from .learning import ChemLearnConfig, ChemLearning

        options = options or ChemLearnConfig()
        return ChemLearning(self, cfg, temperatures=options.temperatures or None, shares=options.shares or None)

    def schema(self, cfg: ChemConfig) -> dict[str, ArraySpec]:
        """One conformer: species, coordinates, DFT energy and forces; a set of molecules pads them to
        ``n_atoms(cfg)`` (species -1) and stores the index of the molecule."""
        n = n_atoms(cfg)
        out = {"species": ArraySpec((n,), "int64"), "coordinates": ArraySpec((n, 3), "float64"),
               "energy": ArraySpec((), "float64"), "forces": ArraySpec((n, 3), "float64")}
        return {**out, "molecule": ArraySpec((), "int64")} if is_multi(cfg) else out

    def sample_parameters(self, cfg: ChemConfig, rng: np.random.Generator) -> dict[str, float]:
        # a float64 holds integers exactly up to 2**53: the conformer's own seed
        seed = float(rng.integers(2**53))
        if not is_multi(cfg):
            return {"conformer_seed": seed}
        return {"molecule": float(rng.integers(len(molecule_set(cfg)))), "conformer_seed": seed}

    def simulate(self, cfg: ChemConfig, params: Mapping[str, float]) -> dict[str, np.ndarray]:
        index = int(params.get("molecule", 0))
        mol = molecule_set(cfg)[index]
        rng = np.random.default_rng(int(params["conformer_seed"]))
        positions = sample_conformer(modes_of(cfg, index), cfg.temperature, rng, cfg.min_distance)
        result = dft_energy_forces(mol.symbols, positions, cfg)
        n = n_atoms(cfg)
        out = {"species": pad_atoms(np.asarray(mol.atomic_numbers, dtype=np.int64), n, PAD_SPECIES),
               "coordinates": pad_atoms(positions.astype(np.float64), n, 0.0),
               "energy": np.float64(result.energy_hartree),
               "forces": pad_atoms(result.forces_hartree_per_angstrom.astype(np.float64), n, 0.0)}
        return {**out, "molecule": np.int64(index)} if is_multi(cfg) else out

    def make_model(self, cfg: ChemConfig) -> ANIPotential:
        return from_config(cfg)

    def make_datasets(self, cfg: ChemConfig, arrays: Mapping[str, np.ndarray], seed: int,
                      val_fraction: float) -> tuple[BatchSource, BatchSource]:
        tensors = {k: torch.from_numpy(np.ascontiguousarray(arrays[k]))
                   for k in ("species", "coordinates", "energy", "forces")}
        if cfg.baseline:  # the network learns what the baseline misses (delta.py)
            e_base, f_base = baseline_energies_forces(cfg.baseline, arrays["species"], arrays["coordinates"])
            tensors["energy"] = tensors["energy"] - torch.from_numpy(e_base)
            tensors["forces"] = tensors["forces"] - torch.from_numpy(f_base)
        train_idx, val_idx = split_indices(len(tensors["energy"]), val_fraction, seed)
        self_energies = training_self_energies(tensors["species"][train_idx], tensors["energy"][train_idx])
        counts = torch.from_numpy(element_counts(tensors["species"]))
        reference = counts @ torch.tensor([self_energies[z] for z in ELEMENTS], dtype=torch.float64)
        tensors["energy_residual"] = tensors["energy"] - reference  # (N,) hartree, float64
        train = ArraySource({k: v[train_idx] for k, v in tensors.items()}, seed=seed)
        val = ArraySource({k: v[val_idx] for k, v in tensors.items()}, seed=seed, shuffle=False)
        return train, val

    def fit_to_data(self, model: torch.nn.Module, train_source: BatchSource) -> None:
        arrays = train_source.arrays  # type: ignore[attr-defined]
        self_energies = training_self_energies(arrays["species"], arrays["energy"])
        scale = fit_energy_scale(arrays["species"], arrays["energy"], self_energies)
        model.set_energy_reference(self_energies, energy_scale=scale)  # type: ignore[operator]

    def forward(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> EnergiesForces:
        dtype = model.energy_scale.dtype  # type: ignore[union-attr]
        return network_energies_forces(model, batch["species"], batch["coordinates"].to(dtype),  # type: ignore[arg-type]
                                       create_graph=model.training and torch.is_grad_enabled())

    def loss(self, cfg: ChemConfig, output: EnergiesForces, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """MSE of energies plus ``force_weight`` x MSE of the real atoms' force components, in kcal/mol (and /Å)."""
        e = hartree_to_kcal_mol(output.energy - batch["energy_residual"].to(output.energy.dtype))
        f = hartree_to_kcal_mol(output.forces - batch["forces"].to(output.forces.dtype))
        real = (batch["species"] > 0).unsqueeze(-1).to(f.dtype)  # (B, A, 1): padding atoms carry no force
        return e.pow(2).mean() + cfg.force_weight * (f.pow(2) * real).sum() / (3 * real.sum()).clamp(min=1)

    def metrics(self, outputs: EnergiesForces, batches: Mapping[str, torch.Tensor]) -> dict[str, float]:
        from .evaluate import error_report

        return error_report(outputs.energy.double().numpy(), outputs.forces.double().numpy(),
                            batches["energy_residual"].double().numpy(), batches["forces"].double().numpy(),
                            real=batches["species"].numpy() > 0)

    def evaluate(self, run_dir: Path, data_dir: Path, out_dir: Path, **options: Any) -> dict:
        from .evaluate import evaluate_run

        return evaluate_run(self, Path(run_dir), Path(data_dir), Path(out_dir), **options)

    def serving_signature(self, cfg: ChemConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        """Any molecule of the trained elements: the atom axis is variable (-1). The batcher groups requests of
        one atom count; a client may also pad (species 0 or -1) to batch molecules of several sizes itself."""
        inputs = [TensorSpec("species", "INT64", (-1, -1)), TensorSpec("coordinates", "FP32", (-1, -1, 3))]
        outputs = [TensorSpec("energy", "FP64", (-1,)), TensorSpec("forces", "FP32", (-1, -1, 3))]
        return inputs, outputs

    def serving_example(self, cfg: ChemConfig, n: int, seed: int = 0) -> dict[str, np.ndarray]:
        """Normal-mode-sampled conformers of the run's molecules in turn, padded (xTB modes, cached per process)."""
        rng = np.random.default_rng(seed)
        mols, size = molecule_set(cfg), n_atoms(cfg)
        species, coordinates = [], []
        for k in range(n):
            index = k % len(mols)
            positions = sample_conformer(modes_of(cfg, index), cfg.temperature, rng, cfg.min_distance)
            species.append(pad_atoms(np.asarray(mols[index].atomic_numbers, dtype=np.int64), size, PAD_SPECIES))
            coordinates.append(pad_atoms(positions, size, 0.0))
        return {"species": np.stack(species), "coordinates": np.stack(coordinates).astype(np.float32)}

    def serve_predict(self, model: torch.nn.Module, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Energies (hartree, float64: self-energies and a baseline's added in float64) and forces (hartree/Å)."""
        species = inputs["species"]
        out = network_energies_forces(model, species, inputs["coordinates"].float(), create_graph=False)
        counts = (species.unsqueeze(-1) == torch.tensor(ELEMENTS, device=species.device)).sum(1).double()  # (B, E)
        energy = out.energy.double() + counts @ model.self_energies.double()  # type: ignore[operator]
        out = model.add_baseline(species, inputs["coordinates"], EnergiesForces(energy, out.forces.double()))
        return {"energy": out.energy, "forces": out.forces.float()}

    uncertainty_label = "energy spread per atom [kcal/mol]"

    def uncertainty(self, cfg: ChemConfig, inputs: Mapping[str, np.ndarray], mean: Mapping[str, np.ndarray],
                    std: Mapping[str, np.ndarray]) -> np.ndarray:
        """``sigma_E / sqrt(N_atoms)`` in kcal/mol, (B,): ANI's query-by-committee score."""
        from .learning import energy_spread_per_atom

        rho = energy_spread_per_atom(torch.from_numpy(np.asarray(std["energy"], dtype=np.float64)),
                                     torch.from_numpy(np.array(inputs["species"], dtype=np.int64)))
        return hartree_to_kcal_mol(rho.numpy())

    def simulate_inputs(self, cfg: ChemConfig, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """DFT energy (B,) hartree and forces (B, A, 3) hartree/Å of the given structures at ``cfg``'s level.

        Padding atoms (species 0 or -1) are left out of the calculation and get zero forces.
        """
        def dft(symbols: list[str], positions: np.ndarray) -> tuple[float, np.ndarray]:
            result = dft_energy_forces(symbols, positions, cfg)
            return result.energy_hartree, result.forces_hartree_per_angstrom

        energy, forces = padded_energies_forces(inputs["species"], inputs["coordinates"], dft)
        return {"energy": energy, "forces": forces}

    def record_training_distribution(self, cfg: ChemConfig, arrays: Mapping[str, np.ndarray], run_dir: Path) -> None:
        """``run_dir/ood.json``: elements, closest pair distances and neighbour counts of the training conformers."""
        from .ood import fit_envelope, save_envelope

        save_envelope(run_dir, fit_envelope(arrays["species"], arrays["coordinates"]))

    def distribution_check(self, cfg: ChemConfig, run_dir: Path):
        """The run's training envelope (``ood.json``, :mod:`converge.apps.chem.ood`), if it has one."""
        from .ood import ENVELOPE_FILE, load_envelope

        if not (Path(run_dir) / ENVELOPE_FILE).is_file():
            return None
        return partial(outside_envelope, load_envelope(run_dir))

    def predict_file(self, run_dir: Path, path: Path, out: Path | None = None) -> Path:
        from .calculator import predict_file

        return predict_file(run_dir, path, out)

    def classical_baseline(self, cfg: ChemConfig, device: torch.device, quick: bool = False) -> Any:
        """DFT at the config's level (the run's, the level the network reproduces; :mod:`.baseline`)."""
        from .baseline import dft_baseline

        return dft_baseline(cfg, device, quick)

    def accuracy_summary(self, cfg: ChemConfig, report: Mapping[str, Any]) -> dict[str, Any]:
        from .baseline import error_summary

        return error_summary(cfg, report)

    def synthetic_batch(self, cfg: ChemConfig, batch_size: int, generator: torch.Generator
                        ) -> dict[str, torch.Tensor]:
        """The molecule's G2 geometry displaced by N(0, 0.03 Å) per coordinate, zero labels (they change no timing)."""
        mol = get_molecule(cfg.molecule)
        r0 = torch.tensor(np.array(mol.positions), dtype=torch.float64)  # (A, 3) Å
        coords = r0 + 0.03 * torch.randn(batch_size, *r0.shape, generator=generator, dtype=torch.float64)
        return {"species": torch.as_tensor(mol.atomic_numbers).repeat(batch_size, 1), "coordinates": coords,
                "energy_residual": torch.zeros(batch_size, dtype=torch.float64), "forces": torch.zeros_like(coords)}

    demo_by_default = True

    def demo(self, out: Path, quick: bool = False, workers: int = 2) -> dict:
        from .demo import CHEM_QUICK, ChemDemoSize, run_chem_demo

        return run_chem_demo(self, Path(out), CHEM_QUICK if quick else ChemDemoSize(), workers)

    def commands(self) -> dict:
        from .commands import screen

        return {"screen": screen}

    def report_sections(self) -> list:
        from .report import SECTIONS

        return list(SECTIONS)

    def summary(self, report: dict) -> dict:
        keys = ("molecule", "level_of_theory", "n_train", "energy_mae_kcal_mol", "force_mae_kcal_mol_A",
                "hot_energy_mae_kcal_mol", "speedup_single", "speedup_batched")
        return {k: report[k] for k in keys if k in report} | {"baselines": report["test"]["baselines"]}
