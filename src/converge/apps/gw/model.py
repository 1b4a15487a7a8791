"""The detection CNN: whitened strain in, one signal logit out.

In the spirit of Deep Filtering (George & Huerta 2018, Phys. Lett. B 778, 64) and
Gabbard et al. 2018 (PRL 120, 141103): stacked 1D convolutions with max pooling
over the whitened time series, then a small dense head.

The head returns the *logit* ``z = log p/(1-p)``, not a probability: the ranking
statistic at low false-alarm rates must not saturate, and a sigmoid (or a
two-class softmax) rounds the loudest noise and the quietest signals to the same
1.0 in float32 (Schäfer et al. 2022, PRD 105, 043002, remove the final softmax for
exactly this reason). ``torch.sigmoid(z)`` gives the probability where wanted.

Several detectors: the network is *coherent*, the detectors are the input channels of
the first convolution (``(B, D, T)``), as in the best MLGWSC-1 entries (TPI FSU Jena,
Schäfer et al. 2023) and Aframe (Marx et al. 2024). Why this and not per-detector scores
joined by coincidence: a coherent network sees the relative time (within the 10 ms light
travel time), phase and amplitude of the two responses, which noise in two detectors
does not reproduce; a coincidence of two single-detector scores throws that away and needs
each detector's score above its own threshold, so it loses the signals that are loud in
one detector and quiet in the other (the antenna patterns make that common). The price:
time slides must re-run the network on each shifted pair (a coincidence search re-pairs
cached per-detector triggers), which the search pays per slide (``search.py``).

Streaming: with ``padding="valid"`` (no zero padding anywhere) the features of a window are a slice
of the features of any longer stretch that holds it, when the window starts on a multiple of the
network's total stride (64 samples). :meth:`DetectionCNN.stream` then scores every window of a
stretch from one pass of the convolutions, exactly as window by window (tested), where the windows
of a search, 1 s long every 0.125 s, overlap eightfold. With ``padding="same"`` (the default, and
every run trained before) each window is scored on its own: near its edges it sees zeros.
"""
from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.fusion import fuse_conv_bn_eval


PADDINGS = ("same", "valid")
STRIDE = 64  # samples per output feature: the stem's 4, then pools of 4, 2 and 2


def conv_block(c_in: int, c_out: int, kernel: int, pool: int, padding: int | None = None) -> nn.Sequential:
    """Conv1d -> BatchNorm -> MaxPool -> ELU: (B, c_in, T) -> (B, c_out, T / pool) (``padding`` None: half the
    kernel, the length kept; 0: valid, ``kernel - 1`` samples fewer).

    ELU is monotonic, so pooling first gives exactly ELU-then-pool while the
    activation runs on ``pool`` times fewer values (~15% of inference time).
    """
    return nn.Sequential(
        nn.Conv1d(c_in, c_out, kernel, padding=kernel // 2 if padding is None else padding, bias=False),
        nn.BatchNorm1d(c_out),
        nn.MaxPool1d(pool),
        nn.ELU(),
    )


class DetectionCNN(nn.Module):
    """1D CNN on a whitened window of ``n_samples`` (``n_detectors`` channels); returns logits of shape (B,).

    The stem is a strided convolution, a learned filter bank that also
    downsamples by 4 (whitened BBH signals carry little power above ~500 Hz at
    2048 Hz sampling), so the deeper blocks run at a quarter of the rate and the
    network costs about 10 MFLOP per 1 s window.
    """

    def __init__(self, n_samples: int, channels: tuple[int, ...] = (16, 32, 64), hidden: int = 64,
                 n_detectors: int = 1, padding: str = "same") -> None:
        super().__init__()
        if padding not in PADDINGS:
            raise ValueError(f"padding={padding!r}: choose one of {', '.join(PADDINGS)}")
        c1, c2, c3 = channels
        pad = 0 if padding == "valid" else None
        self.features = nn.Sequential(
            nn.Conv1d(n_detectors, c1, 32, stride=4, padding=14 if pad is None else 0, bias=False),  # (B, c1, N/4)
            nn.BatchNorm1d(c1),
            nn.ELU(),
            conv_block(c1, c2, kernel=9, pool=4, padding=pad),  # (B, c2, N/16)
            conv_block(c2, c3, kernel=9, pool=2, padding=pad),  # (B, c3, N/32)
            conv_block(c3, c3, kernel=9, pool=2, padding=pad),  # (B, c3, N/64)
        )
        # Max over time makes the score independent of where the merger sits in
        # the window; the mean keeps a measure of the overall excess power.
        self.head = nn.Sequential(
            nn.Linear(2 * c3, hidden),
            nn.ELU(),
            nn.Dropout(0.1),
            nn.Linear(hidden, 1),
        )
        self.n_samples = n_samples
        self.n_detectors = n_detectors
        self.padding = padding
        self.features.eval()  # features per window (N/64 with "same", fewer with "valid"), stats untouched
        with torch.no_grad():
            self.window_features = int(self.features(torch.zeros(1, n_detectors, n_samples)).shape[-1])
        self.features.train()
        if self.window_features < 1:
            raise ValueError(f"a window of {n_samples} samples is too short for this network")

    @property
    def streamable(self) -> bool:
        """Whether :meth:`stream` scores overlapping windows exactly as :meth:`forward` does."""
        return self.padding == "valid"

    def forward(self, strain: torch.Tensor) -> torch.Tensor:
        """``strain`` (B, N) for one detector, (B, D, N) for a network."""
        x = strain.unsqueeze(1) if strain.dim() == 2 else strain  # (B, D, N)
        return self.score_features(self.features(x))  # features (B, C, N/64)

    def stream(self, strain: torch.Tensor, step: int) -> torch.Tensor:
        """Logits of every window of ``n_samples`` starting each ``step`` samples (a multiple of ``STRIDE``) in one
        stretch ``strain`` (D, T) or (T,), from one pass of the convolutions: ``1 + (T - n_samples) // step``
        logits, equal to :meth:`forward` on each window (``padding="valid"`` only)."""
        if not self.streamable or step % STRIDE:
            raise ValueError(f"stream needs padding='valid' (this network: {self.padding!r}) and a step that is a "
                             f"multiple of {STRIDE} samples (got {step})")
        x = strain.reshape(1, -1, strain.shape[-1])  # (1, D, T)
        h = self.features(x)  # (1, C, L)
        n_windows = 1 + (x.shape[-1] - self.n_samples) // step
        h = h[..., : (n_windows - 1) * (step // STRIDE) + self.window_features]
        # each window's max and mean over its features, as score_features takes them, by pooling with the
        # windows' stride (8x cheaper than pooling the overlapping windows one by one)
        pooled = torch.cat([F.max_pool1d(h, self.window_features, step // STRIDE),
                            F.avg_pool1d(h, self.window_features, step // STRIDE)], dim=1)[0]  # (2C, n)
        return self.head_logits(pooled.T)

    def for_inference(self, copy_model: bool = True) -> "DetectionCNN":
        """An eval-mode copy for scoring (``copy_model`` False: this model, changed in place), each BatchNorm
        folded into the convolution before it (``torch.nn.utils.fusion.fuse_conv_bn_eval``): the same logits
        to float rounding (tested), and on a CPU a third cheaper, since a BatchNorm of eval statistics costs
        about as much as the convolution."""
        model = (copy.deepcopy(self) if copy_model else self).eval()
        blocks = [model.features] + [m for m in model.features if isinstance(m, nn.Sequential)]
        for block in blocks:
            for i in range(len(block) - 1):
                if isinstance(block[i], nn.Conv1d) and isinstance(block[i + 1], nn.BatchNorm1d):
                    block[i] = fuse_conv_bn_eval(block[i], block[i + 1])
                    block[i + 1] = nn.Identity()
        return model

    def score_features(self, h: torch.Tensor) -> torch.Tensor:
        """The head on features (B, C, L): logits (B,)."""
        return self.head_logits(torch.cat([h.amax(dim=-1), h.mean(dim=-1)], dim=-1))  # pooled (B, 2C)

    def head_logits(self, pooled: torch.Tensor) -> torch.Tensor:
        """The dense head on pooled features (B, 2C): logits (B,)."""
        # The head runs in fp32 even under bf16 autocast: a bf16 logit keeps only
        # ~3 significant digits, which would tie scores at low false-alarm rates.
        with torch.autocast(device_type=pooled.device.type, enabled=False):
            return self.head(pooled.float()).squeeze(-1)  # (B,)
