"""The surrogate: a two-dimensional Fourier neural operator (FNO) from permeability k to pressure u.

Li, Kovachki, Azizzadenesheli, Liu, Bhattacharya, Stuart and Anandkumar,
"Fourier neural operator for parametric partial differential equations", ICLR
2021 (their ``fourier_2d.py``): lift the input channels (normalised k and the x, y
node coordinates) pointwise to ``width`` channels; ``layers`` Fourier layers
``v <- GELU(K v + W v)``, where ``K`` multiplies the lowest ``modes`` x ``modes``
Fourier coefficients (both signs of the first frequency, the real FFT's half of
the second) by learned complex matrices and drops the rest, and ``W`` is a 1 x 1
convolution (no GELU after the last layer); project pointwise through a hidden
layer of 128 to one channel. The grid is zero-padded by ``padding`` nodes on the
high side of each axis before the Fourier layers (the pressure is not periodic)
and cropped after.

Written here rather than taken from the ``neuraloperator`` package: it installs
beside torch 2.13 (``pip install --dry-run`` changes no torch) but brings 21
further distributions (wandb, opentelemetry, tensorly, pytest-mock, ...) for
what is ~80 lines, and an example app should show the contract, not a
dependency tree.

Normalisation lives in buffers, set from the training data by :meth:`FNO2d.set_normalisation`
(``App.fit_to_data``) and saved with every checkpoint, so the model takes raw k and
returns u: ``a = (k - k_mean) / k_std`` on the way in, ``u = u_scale * output`` on
the way out, both scalars (a per-node normaliser, as in the FNO code, would tie the
model to one resolution). The output is set to zero on the boundary nodes, where
``u = 0`` exactly. Any resolution runs: the learned Fourier weights act on modes,
not nodes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PROJECTION_HIDDEN = 128  # the projection's hidden channels, as in the FNO paper's code


def spectral_convolution(x: torch.Tensor, weight_low: torch.Tensor, weight_high: torch.Tensor,
                         modes: int) -> torch.Tensor:
    """``K v``: keep the lowest Fourier modes of ``x`` and mix their channels.

    ``out = irfft2(R . rfft2(x))`` with ``(R . X)[o, k1, k2] = sum_i X[i, k1, k2] R[i, o, k1, k2]``
    for ``|k1| < modes`` (``weight_low`` for k1 >= 0, ``weight_high`` for k1 < 0) and
    ``0 <= k2 < modes``; every other coefficient is zero. ``x``: (B, C_in, X, Y) real;
    weights: (C_in, C_out, modes, modes) complex; returns (B, C_out, X, Y) float32.
    Computed in float32 whatever the autocast: FFTs need it.
    """
    with torch.autocast(x.device.type, enabled=False):
        x = x.float()
        b, _, nx, ny = x.shape
        x_ft = torch.fft.rfft2(x)  # (B, C_in, X, Y // 2 + 1) complex
        out_ft = torch.zeros(b, weight_low.shape[1], nx, ny // 2 + 1, dtype=x_ft.dtype, device=x.device)
        out_ft[:, :, :modes, :modes] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, :modes, :modes], weight_low)
        out_ft[:, :, -modes:, :modes] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, -modes:, :modes], weight_high)
        return torch.fft.irfft2(out_ft, s=(nx, ny))  # (B, C_out, X, Y)


def relative_l2(prediction: torch.Tensor, target: torch.Tensor, eps: float = 1e-30) -> torch.Tensor:
    """``||prediction - target||_2 / ||target||_2`` per field over all but the batch axis: (B, ...) -> (B,).

    The FNO paper's error (and loss); on a uniform grid the discrete norms' ratio is the
    ratio of the continuous L2 norms up to quadrature error. ``eps`` keeps a zero target finite.
    """
    diff = (prediction - target).flatten(1)
    return torch.linalg.vector_norm(diff, dim=1) / torch.linalg.vector_norm(target.flatten(1), dim=1).clamp_min(eps)


def node_coordinates(nx: int, ny: int, device: torch.device) -> torch.Tensor:
    """(X, Y, 2) coordinates of an nx x ny grid of nodes on the unit square, boundary included."""
    x = torch.linspace(0.0, 1.0, nx, device=device)
    y = torch.linspace(0.0, 1.0, ny, device=device)
    return torch.stack(torch.meshgrid(x, y, indexing="ij"), dim=-1)


def zero_boundary(u: torch.Tensor) -> torch.Tensor:
    """``u`` (B, X, Y) with its boundary nodes set to 0 (the Dirichlet condition), out of place."""
    mask = torch.zeros(u.shape[-2:], dtype=u.dtype, device=u.device)
    mask[1:-1, 1:-1] = 1
    return u * mask


class SpectralConv2d(nn.Module):
    """A Fourier layer's ``K``: learned complex weights on the lowest ``modes`` x ``modes`` modes.

    The weights are stored as real tensors (..., 2) so that optimisers, checkpoints and
    all-reduces see plain float32; ``forward`` views them as complex.
    """

    def __init__(self, channels_in: int, channels_out: int, modes: int) -> None:
        super().__init__()
        self.modes = modes
        scale = 1.0 / (channels_in * channels_out)  # the FNO code's initialisation
        shape = (channels_in, channels_out, modes, modes, 2)
        self.weight_low = nn.Parameter(scale * torch.rand(shape))
        self.weight_high = nn.Parameter(scale * torch.rand(shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return spectral_convolution(x, torch.view_as_complex(self.weight_low), torch.view_as_complex(self.weight_high),
                                    self.modes)


class FNO2d(nn.Module):
    """k (B, X, Y) raw permeability -> u (B, X, Y) pressure (module docstring)."""

    def __init__(self, width: int = 32, modes: int = 12, layers: int = 4, padding: int = 8) -> None:
        super().__init__()
        self.padding = padding
        self.lift = nn.Linear(3, width)  # (normalised k, x, y) -> width
        self.spectral = nn.ModuleList(SpectralConv2d(width, width, modes) for _ in range(layers))
        self.pointwise = nn.ModuleList(nn.Conv2d(width, width, 1) for _ in range(layers))
        self.project = nn.Sequential(nn.Linear(width, PROJECTION_HIDDEN), nn.GELU(), nn.Linear(PROJECTION_HIDDEN, 1))
        self.register_buffer("k_mean", torch.tensor(0.0))
        self.register_buffer("k_std", torch.tensor(1.0))
        self.register_buffer("u_scale", torch.tensor(1.0))

    @torch.no_grad()
    def set_normalisation(self, k: torch.Tensor, u: torch.Tensor) -> None:
        """Scalars from training fields k, u (N, X, Y): mean and std of k, root mean square of u."""
        k, u = k.double(), u.double()
        self.k_mean.fill_(float(k.mean()))
        self.k_std.fill_(max(float(k.std()), 1e-12))  # a constant k (std 0) stays finite
        self.u_scale.fill_(max(float(u.pow(2).mean().sqrt()), 1e-12))

    def forward(self, k: torch.Tensor) -> torch.Tensor:
        b, nx, ny = k.shape
        a = (k.float() - self.k_mean) / self.k_std  # (B, X, Y)
        grid = node_coordinates(nx, ny, k.device).expand(b, nx, ny, 2)  # (B, X, Y, 2)
        v = self.lift(torch.cat([a.unsqueeze(-1), grid], dim=-1))  # (B, X, Y, W)
        v = F.pad(v.permute(0, 3, 1, 2), [0, self.padding, 0, self.padding])  # (B, W, X + p, Y + p)
        for i, (spectral, pointwise) in enumerate(zip(self.spectral, self.pointwise)):
            v = spectral(v) + pointwise(v)
            if i < len(self.spectral) - 1:
                v = F.gelu(v)
        v = v[..., :nx, :ny].permute(0, 2, 3, 1)  # (B, X, Y, W)
        u = self.project(v).squeeze(-1) * self.u_scale  # (B, X, Y)
        return zero_boundary(u)
