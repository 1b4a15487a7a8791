"""ANI-style neural network potential: AEV -> one MLP per element -> atomic energies.

ANAKIN-ME / ANI-1 (Smith, Isayev & Roitberg 2017, Chem. Sci. 8, 3192). The energy of
a molecule is a sum of atomic contributions, each a function of the atom's local
environment only, which makes it invariant to rotation, translation and permutation
of like atoms, and size-extensive::

    E = sum_i [ E_self(Z_i) + s * NN_{Z_i}(G_i) ]          (hartree)
    F_i = -dE/dr_i                                         (hartree/Å)

``G_i`` is the atomic environment vector (``aev.py``), ``NN_Z`` the element's MLP
(``AEV -> hidden... -> 1`` with CELU(alpha=0.1) activations, as ANI-1x), ``E_self``
fixed per-element self energies (the ``self_energies`` buffer, fitted by linear least
squares with ``fit_self_energies``) and ``s`` the ``energy_scale`` buffer (hartree).

Why the two buffers: total DFT energies are ~ -40 hartree per heavy atom while the
conformational part the network must learn spans a few millihartree. Subtracting the
self energies leaves the residual; dividing it by ``s`` (``fit_energy_scale``: its
standard deviation) makes the network's targets O(1), the range its default
initialisation produces. No separate energy shift is kept: a constant per atom is
exactly a change of the self energies. ``network_energy`` returns the scaled network
part alone, so a training loop can subtract the self energies from the labels in
float64 once and train on residuals in float32 without the cancellation of two
~100-hartree numbers.

Inputs: ``species`` (B, A) int64 atomic numbers (1, 6, 7, 8), with 0 or -1 marking
padding atoms (their coordinates are ignored, they contribute no energy and get zero
force); ``coordinates`` (B, A, 3) in Å, of the model's dtype (float32 or float64;
``model.double()`` for finite-difference checks). The model always runs in its own
dtype, autocast disabled: bf16 cannot resolve millihartree energy differences.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
from torch import Tensor, nn

from .aev import ELEMENTS, AtomicEnvironment, ElementIndex

if TYPE_CHECKING:
    from .config import ChemConfig

SYMBOLS = {1: "H", 6: "C", 7: "N", 8: "O", 9: "F", 16: "S", 17: "Cl"}


class EnergiesForces(NamedTuple):
    energy: Tensor  # (B,) hartree
    forces: Tensor  # (B, A, 3) hartree/Å, zero on padding atoms


def element_network(in_dim: int, hidden: Sequence[int], celu_alpha: float = 0.1) -> nn.Sequential:
    """MLP ``in_dim -> hidden[0] -> ... -> 1`` with CELU activations: (N, in_dim) -> (N, 1)."""
    layers: list[nn.Module] = []
    for width in hidden:
        layers += [nn.Linear(in_dim, width), nn.CELU(celu_alpha)]
        in_dim = width
    layers.append(nn.Linear(in_dim, 1))
    return nn.Sequential(*layers)


class ANIPotential(nn.Module):
    """Energy (B,) in hartree of molecules given atomic numbers (B, A) and coordinates (B, A, 3) Å."""

    self_energies: Tensor
    energy_scale: Tensor

    def __init__(self, hidden: Sequence[int] = (160, 128, 96), aev_preset: str = "ani1x",
                 elements: Sequence[int] = ELEMENTS, celu_alpha: float = 0.1, baseline: str = "") -> None:
        super().__init__()
        self.baseline = baseline  # "gfn2_xtb": energies_forces adds GFN2-xTB's to the network's (delta.py)
        self.element_index = ElementIndex(elements)
        self.elements = self.element_index.elements
        self.aev = AtomicEnvironment(aev_preset, num_species=len(self.elements))
        self.networks = nn.ModuleDict({
            SYMBOLS.get(z, f"Z{z}"): element_network(self.aev.out_dim, hidden, celu_alpha)
            for z in self.elements
        })
        self.register_buffer("self_energies", torch.zeros(len(self.elements)))  # hartree, per element
        self.register_buffer("energy_scale", torch.tensor(1.0))  # hartree per unit network output

    def set_energy_reference(self, self_energies: Mapping[int, float], energy_scale: float = 1.0) -> None:
        """Set the self energies (hartree, by atomic number; missing elements -> 0) and the scale."""
        unknown = set(self_energies) - set(self.elements)
        if unknown:
            raise ValueError(f"self energies given for {sorted(unknown)}, not in the model's elements {self.elements}")
        if not energy_scale > 0:
            raise ValueError(f"energy_scale={energy_scale}: must be > 0 hartree")
        values = [float(self_energies.get(z, 0.0)) for z in self.elements]
        self.self_energies.copy_(torch.tensor(values, dtype=torch.float64))
        self.energy_scale.fill_(float(energy_scale))

    def _check_inputs(self, species: Tensor, coordinates: Tensor) -> None:
        if species.dim() != 2 or coordinates.shape != (*species.shape, 3):
            raise ValueError(f"species must be (B, A) and coordinates (B, A, 3); got "
                             f"{tuple(species.shape)} and {tuple(coordinates.shape)}")
        if coordinates.dtype != self.energy_scale.dtype:
            raise TypeError(f"coordinates are {coordinates.dtype} but the model is {self.energy_scale.dtype}: "
                            f"cast one to the other (e.g. model.double() for float64)")

    def _network_atomic(self, index: Tensor, coordinates: Tensor) -> Tensor:
        """Scaled network output per atom, (B, A), zero on padding atoms."""
        aev = self.aev(index, coordinates).flatten(0, 1)  # (B*A, D)
        flat_index = index.flatten()  # (B*A,)
        out = aev.new_zeros(flat_index.shape[0])
        for k, net in enumerate(self.networks.values()):
            atoms = (flat_index == k).nonzero().squeeze(-1)
            if atoms.numel():
                out = out.index_add(0, atoms, net(aev.index_select(0, atoms)).squeeze(-1))
        return self.energy_scale * out.view_as(index)

    def _self_atomic(self, index: Tensor) -> Tensor:
        """Self energy per atom, (B, A), zero on padding atoms."""
        per_atom = self.self_energies[index.clamp(min=0)]
        return torch.where(index >= 0, per_atom, torch.zeros_like(per_atom))

    def atomic_energies(self, species: Tensor, coordinates: Tensor) -> Tensor:
        """E_self(Z_i) + s NN(G_i) per atom, (B, A) hartree; zero on padding atoms."""
        self._check_inputs(species, coordinates)
        index = self.element_index(species)
        with torch.autocast(device_type=coordinates.device.type, enabled=False):
            return self._self_atomic(index) + self._network_atomic(index, coordinates)

    def network_energy(self, species: Tensor, coordinates: Tensor) -> Tensor:
        """s * sum_i NN(G_i): the energy minus the self energies, (B,) hartree."""
        self._check_inputs(species, coordinates)
        index = self.element_index(species)
        with torch.autocast(device_type=coordinates.device.type, enabled=False):
            return self._network_atomic(index, coordinates).sum(-1)

    def self_energy(self, species: Tensor) -> Tensor:
        """sum_i E_self(Z_i), (B,) hartree, in the model's dtype."""
        return self._self_atomic(self.element_index(species)).sum(-1)

    def forward(self, species: Tensor, coordinates: Tensor) -> Tensor:
        return self.atomic_energies(species, coordinates).sum(-1)  # (B,)

    def energies_forces(self, species: Tensor, coordinates: Tensor, create_graph: bool = False) -> EnergiesForces:
        """Energy (B,) hartree and forces -dE/dr (B, A, 3) hartree/Å by autograd.

        ``create_graph=False`` (inference): both are returned detached. ``True``
        (training with a force loss): both keep their graphs, so a loss on them
        backpropagates to the parameters (double backward through the AEV).
        Works under ``torch.no_grad()`` and ``torch.inference_mode()`` (it leaves
        inference mode for the gradient); the input tensor is not modified.
        """
        with torch.inference_mode(False), torch.enable_grad():
            if coordinates.requires_grad:
                coords = coordinates
            else:  # clone: an inference-mode tensor cannot itself take part in autograd
                coords = coordinates.detach().clone().requires_grad_(True)
            energy = self(species, coords)
            (gradient,) = torch.autograd.grad(energy.sum(), coords, create_graph=create_graph)
        if not create_graph:
            energy = energy.detach()
        return self.add_baseline(species, coordinates, EnergiesForces(energy, -gradient))

    def add_baseline(self, species: Tensor, coordinates: Tensor, out: EnergiesForces) -> EnergiesForces:
        """``out`` plus the baseline's energies and forces at ``coordinates`` (computed on the CPU in float64,
        added in ``out``'s dtypes); ``out`` itself if the model has no baseline."""
        if not self.baseline:
            return out
        from .delta import baseline_energies_forces

        e, f = baseline_energies_forces(self.baseline, species.detach().cpu().numpy(),
                                        coordinates.detach().cpu().double().numpy())
        return EnergiesForces(out.energy + torch.as_tensor(e, dtype=out.energy.dtype, device=out.energy.device),
                              out.forces + torch.as_tensor(f, dtype=out.forces.dtype, device=out.forces.device))


def _numpy(x: Tensor | np.ndarray | Sequence) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, Tensor) else np.asarray(x)


def element_counts(species: Tensor | np.ndarray, elements: Sequence[int] = ELEMENTS) -> np.ndarray:
    """(B, A) atomic numbers (0/-1 padding) -> (B, len(elements)) float64 counts of each element."""
    z = _numpy(species)
    if z.ndim != 2:
        raise ValueError(f"species must be (B, A) atomic numbers, got shape {z.shape}")
    unknown = set(np.unique(z[z > 0]).tolist()) - set(elements)
    if unknown:
        raise ValueError(f"atomic numbers {sorted(unknown)} are not among elements={tuple(elements)}")
    return np.stack([(z == e).sum(axis=1) for e in elements], axis=1).astype(np.float64)


def fit_self_energies(species: Tensor | np.ndarray, energies: Tensor | np.ndarray,
                      elements: Sequence[int] = ELEMENTS) -> dict[int, float]:
    """Per-element energies (hartree) minimising sum_b (E_b - sum_e n_be E_self(e))^2.

    ``n_be`` counts element ``e`` in molecule ``b``; the fit is the minimum-norm
    linear least-squares solution (SVD, ``numpy.linalg.lstsq``), the zero-ridge limit.
    With several molecules whose compositions span the elements it is the unique
    least-squares fit. When the counts are rank deficient, most plainly when the data
    are conformers of one molecule (every row the same ``n``), only ``n . E_self`` is
    determined: the minimum-norm answer is ``E_self = n * mean(E) / |n|^2``, so the
    self energies reproduce the mean energy exactly but split it among the elements
    in proportion to their counts, not as physical atomic energies. Elements absent
    from the data get 0. The network then learns the deviation from the mean.
    """
    counts = element_counts(species, elements)  # (B, E)
    target = _numpy(energies).astype(np.float64).reshape(-1)  # (B,)
    if target.shape[0] != counts.shape[0]:
        raise ValueError(f"{counts.shape[0]} molecules but {target.shape[0]} energies")
    if not np.all(np.isfinite(target)):
        raise ValueError("energies contain NaN or inf")
    solution, *_ = np.linalg.lstsq(counts, target, rcond=None)
    return {int(e): float(v) for e, v in zip(elements, solution)}


def fit_energy_scale(species: Tensor | np.ndarray, energies: Tensor | np.ndarray,
                     self_energies: Mapping[int, float]) -> float:
    """Standard deviation (hartree) of E_b - sum_i E_self(Z_i): a value for ``energy_scale``."""
    elements = tuple(self_energies)
    residual = _numpy(energies).astype(np.float64).reshape(-1) - element_counts(species, elements) @ np.array(
        [self_energies[e] for e in elements])
    if residual.shape[0] < 2 or not residual.std() > 0:
        raise ValueError("need at least two molecules with different residual energies to set a scale")
    return float(residual.std())


def finite_difference_forces(energy_fn: Callable[[Tensor, Tensor], Tensor], species: Tensor,
                             coordinates: Tensor, step: float = 1e-4) -> Tensor:
    """Central differences -(E(r + h e_k) - E(r - h e_k)) / 2h: (B, A, 3) forces.

    All 6A displaced copies of each molecule go through ``energy_fn`` in one batch.
    The error is O(h^2 E''') + O(eps E / h); h = 1e-4 Å in float64 gives ~1e-8.
    """
    b, a, _ = coordinates.shape
    eye = torch.eye(3 * a, dtype=coordinates.dtype, device=coordinates.device).view(3 * a, a, 3)
    displacements = torch.cat([eye, -eye]) * step  # (6A, A, 3)
    displaced = (coordinates.unsqueeze(1) + displacements).flatten(0, 1)  # (B*6A, A, 3)
    repeated = species.unsqueeze(1).expand(b, 6 * a, a).flatten(0, 1)  # (B*6A, A)
    with torch.no_grad():
        energy = energy_fn(repeated, displaced).view(b, 2, 3 * a)  # (B, +/-, 3A)
    return (-(energy[:, 0] - energy[:, 1]) / (2 * step)).view(b, a, 3)


def from_config(cfg: ChemConfig) -> ANIPotential:
    """The potential described by the app settings (``hidden`` widths, ``aev_preset``, ``baseline``)."""
    return ANIPotential(hidden=tuple(cfg.hidden), aev_preset=cfg.aev_preset, baseline=cfg.baseline)
