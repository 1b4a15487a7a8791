"""Atomic environment vectors (AEVs) of ANI: the per-atom input of the element networks.

Smith, Isayev & Roitberg 2017, Chem. Sci. 8, 3192 (ANI-1, eqs. 2-4), with the
ANI-1x constants (Smith et al. 2018, J. Chem. Phys. 148, 241733). The computation
is torchani's ``AEVComputer`` (pure-PyTorch strategy); this module fixes the
preset, maps atomic numbers to element indices and documents the terms. For the
atom ``i`` (all distances in Å):

Cosine cutoff (eq. 2), zero beyond ``R_c`` so that the AEV is strictly local::

    f_C(R; R_c) = 0.5 cos(pi R / R_c) + 0.5     for R <= R_c,   0 otherwise

Radial part, one block of ``len(R_s)`` features per neighbour element ``a``::

    G^R_{i,a,k} = sum_{j != i, Z_j = a} 0.25 exp(-eta_R (R_ij - R_s,k)^2) f_C(R_ij; R_cr)

Angular part, one block per unordered element pair ``{a, b}`` (HH, HC, HN, HO, CC,
CN, CO, NN, NO, OO), features ordered (radial shift m, angle section n), n fastest::

    G^A_{i,ab,mn} = sum_{j<k, {Z_j,Z_k}={a,b}} 2^(1-zeta) (1 + cos(theta'_ijk - theta_s,n))^zeta
                    * exp(-eta_A ((R_ij + R_ik)/2 - R_s,m)^2) f_C(R_ij; R_ca) f_C(R_ik; R_ca)

    theta'_ijk = arccos(0.95 cos theta_ijk)

Two conventions follow NeuroChem (the code ANI was trained with), not the paper's
printed equations: the 0.25 in the radial term, and the 0.95 inside the arccos (it
keeps the gradient of arccos finite at collinear triples). Each unordered pair
{j, k} is counted once.

ANI-1x constants (``ani1x``): R_cr = 5.2, R_ca = 3.5, eta_R = 16, eta_A = 8,
zeta = 32; 16 radial shifts R_s,k = 0.9 + k (5.2 - 0.9)/16; angular shifts
R_s,m = 0.9 + m (3.5 - 0.9)/4 (4 of them); 8 angle sections theta_s,n =
pi/16 + n pi/8. Length for 4 elements: 4*16 + 10*(4*8) = 64 + 320 = 384.
``ani2x`` (Devereux et al. 2020) uses R_cr = 5.1, eta_R = 19.7, eta_A = 12.5,
zeta = 14.1, 8 angular shifts from 0.8 and 4 sections: 4*16 + 10*32 = 384 too.
``ani1x_r4`` is ANI-1x with R_cr = 4.0 (16 radial shifts over 0.9-4.0 Å, the rest
unchanged, length 384): a potential trained on molecules of at most 4 heavy atoms
rarely sees neighbours between 4 and 5.2 Å, and larger molecules have many there.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .config import AEV_PRESETS as PRESETS

with warnings.catch_warnings():
    # torchani warns on import that its optional CUDA extensions (cuAEV) are absent;
    # the pure-PyTorch strategy used here needs none of them.
    warnings.filterwarnings("ignore", message="The extensions", category=UserWarning)
    from torchani.aev import AEVComputer

ELEMENTS: tuple[int, ...] = (1, 6, 7, 8)  # H, C, N, O: the CHNO set of ANI-1x
MAX_ATOMIC_NUMBER = 118
RADIAL_CUTOFF_R4 = 4.0  # Å, the radial cutoff of the ani1x_r4 preset (ANI-1x: 5.2)


def cosine_cutoff(distances: Tensor, cutoff: float) -> Tensor:
    """f_C(R) = 0.5 cos(pi R / R_c) + 0.5 for R <= R_c, else 0 (eq. 2 of ANI-1); any shape."""
    inside = distances <= cutoff
    return torch.where(inside, 0.5 * torch.cos(distances * (math.pi / cutoff)) + 0.5,
                       torch.zeros_like(distances))


def radial_terms(distances: Tensor, eta: float, shifts: Tensor, cutoff: float) -> Tensor:
    """0.25 exp(-eta (R - R_s)^2) f_C(R): (P,) pair distances in Å -> (P, len(shifts))."""
    r = distances.unsqueeze(-1)  # (P, 1)
    return 0.25 * torch.exp(-eta * (r - shifts) ** 2) * cosine_cutoff(r, cutoff)


def angular_terms(r_ij: Tensor, r_ik: Tensor, cos_theta: Tensor, eta: float, zeta: float,
                  shifts: Tensor, sections: Tensor, cutoff: float) -> Tensor:
    """ANI angular term of triples: (T,) distances, (T,) cos theta_ijk -> (T, M*N), N fastest.

    ``2^(1-zeta) (1 + cos(theta' - theta_s))^zeta exp(-eta ((R_ij+R_ik)/2 - R_s)^2)
    f_C(R_ij) f_C(R_ik)`` with ``theta' = arccos(0.95 cos theta)``.
    """
    theta = torch.acos(0.95 * cos_theta).unsqueeze(-1)  # (T, 1)
    angle = 2.0 * ((1.0 + torch.cos(theta - sections)) / 2.0) ** zeta  # (T, N)
    mean_r = ((r_ij + r_ik) / 2.0).unsqueeze(-1)  # (T, 1)
    radial = torch.exp(-eta * (mean_r - shifts) ** 2)  # (T, M)
    envelope = (cosine_cutoff(r_ij, cutoff) * cosine_cutoff(r_ik, cutoff)).unsqueeze(-1)
    return (radial.unsqueeze(-1) * angle.unsqueeze(-2)).flatten(-2) * envelope  # (T, M*N)


def aev_computer(preset: str = "ani1x", num_species: int = len(ELEMENTS)) -> AEVComputer:
    """torchani's AEVComputer with a named preset's constants (cosine cutoff, all-pairs list)."""
    if preset == "ani1x":
        return AEVComputer.like_1x(num_species=num_species, strategy="pyaev")
    if preset == "ani2x":
        return AEVComputer.like_2x(num_species=num_species, strategy="pyaev")
    if preset == "ani1x_r4":
        return AEVComputer.like_1x(num_species=num_species, strategy="pyaev", radial_cutoff=RADIAL_CUTOFF_R4)
    raise ValueError(f"aev_preset={preset!r}: choose one of {', '.join(PRESETS)}")


class ElementIndex(nn.Module):
    """Atomic numbers (B, A) -> element indices (B, A): ``elements[k]`` -> k, padding -> -1.

    Padding atoms are marked by atomic number 0 or -1. Any other atomic number not in
    ``elements`` is an error, since its network does not exist.
    """

    table: Tensor

    def __init__(self, elements: Sequence[int] = ELEMENTS) -> None:
        super().__init__()
        if len(set(elements)) != len(elements) or not all(0 < z <= MAX_ATOMIC_NUMBER for z in elements):
            raise ValueError(f"elements={tuple(elements)}: give distinct atomic numbers in 1..118")
        self.elements = tuple(int(z) for z in elements)
        table = torch.full((MAX_ATOMIC_NUMBER + 2,), -2, dtype=torch.long)  # -2: unsupported
        table[0] = table[-1] = -1  # index -1 of the table serves atomic number -1
        table[list(self.elements)] = torch.arange(len(self.elements))
        self.register_buffer("table", table, persistent=False)

    def forward(self, atomic_numbers: Tensor) -> Tensor:
        if atomic_numbers.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"species must be an integer tensor of atomic numbers, got {atomic_numbers.dtype}")
        outside = (atomic_numbers < -1) | (atomic_numbers > MAX_ATOMIC_NUMBER)
        index = self.table[atomic_numbers.long().clamp(-1, MAX_ATOMIC_NUMBER)]
        if bool((outside | (index == -2)).any()):
            bad = sorted(set(atomic_numbers[outside | (index == -2)].tolist()))
            raise ValueError(f"atomic numbers {bad} are not supported: this model has networks for "
                             f"{self.elements}; pad with 0 or -1")
        return index


class AtomicEnvironment(nn.Module):
    """Element indices (B, A) and coordinates (B, A, 3) in Å -> AEVs (B, A, out_dim).

    Wraps torchani's ``AEVComputer`` (see the module docstring for the terms).
    Padding atoms (index -1) have all-zero AEVs and do not enter their neighbours'.
    The constants are float buffers: ``.double()`` / ``.to(device)`` move them.
    """

    def __init__(self, preset: str = "ani1x", num_species: int = len(ELEMENTS)) -> None:
        super().__init__()
        self.preset = preset
        self.computer = aev_computer(preset, num_species)
        self.out_dim: int = self.computer.out_dim
        self.radial_cutoff: float = self.computer.radial.cutoff
        self.angular_cutoff: float = self.computer.angular.cutoff

    def forward(self, element_index: Tensor, coordinates: Tensor) -> Tensor:
        return self.computer(element_index, coordinates)  # (B, A, out_dim)
