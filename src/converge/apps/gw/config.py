"""Settings of the gravitational-wave app (the ``[app]`` table of a config file)."""
from __future__ import annotations

from dataclasses import dataclass

from ...config import ConfigError

DETECTORS = ("H1", "L1")


@dataclass(frozen=True)
class GWConfig:
    """Physics and data-pipeline settings of the gw app.

    Times in seconds, frequencies in Hz, masses in solar masses (detector frame).
    A stored sample is the whitened detector response over
    ``window + merger_max - merger_min`` seconds with the merger at ``merger_max``
    seconds; the data pipeline crops a ``window`` at a random offset so the merger
    lands in [merger_min, merger_max] seconds of the window.
    """

    sample_rate: int = 2048
    window: float = 1.0
    f_lower: float = 20.0
    segment: float = 32.0  # whitening segment; must exceed the longest signal from f_lower
    psd: str = "aLIGOZeroDetHighPower"
    approximant: str = "IMRPhenomD"
    detector: str = "H1"
    mass_min: float = 5.0
    mass_max: float = 95.0
    merger_min: float = 0.5
    merger_max: float = 0.95
    snr_min: float = 5.0
    # Training SNRs: 5-15 and 40% signal windows beat 5-20 and 50% at FAP 1e-3 (the loud
    # signals are easy; the noise tail is what sets the threshold): benchmarks/results/gw.json
    snr_max: float = 15.0
    signal_fraction: float = 0.4  # share of training windows that hold a signal
    # curriculum: the lowest training SNR starts at curriculum_snr and falls to
    # snr_min over the first curriculum_fraction of the epochs
    curriculum_snr: float = 12.0
    curriculum_fraction: float = 0.5
    # CNN width: channels of the three conv blocks
    channels: tuple[int, ...] = (16, 32, 64)
    hidden: int = 64

    def __post_init__(self) -> None:
        if self.sample_rate not in (1024, 2048, 4096, 8192, 16384):
            raise ConfigError(f"app.sample_rate={self.sample_rate}: use a power of two from 1024 to 16384 Hz")
        if not 0 < self.f_lower < self.sample_rate / 2:
            raise ConfigError(f"app.f_lower={self.f_lower}: must be between 0 and the Nyquist frequency")
        if self.detector not in DETECTORS:
            raise ConfigError(f"app.detector={self.detector!r}: choose one of {', '.join(DETECTORS)}")
        if not 1.0 <= self.mass_min < self.mass_max <= 300.0:
            raise ConfigError(
                f"app.mass_min/mass_max=({self.mass_min}, {self.mass_max}): need 1 <= mass_min < mass_max <= 300"
            )
        if not 0 <= self.merger_min < self.merger_max <= self.window:
            raise ConfigError(
                f"app.merger_min/merger_max=({self.merger_min}, {self.merger_max}): need 0 <= min < max <= window"
            )
        if not 0 < self.snr_min <= self.snr_max:
            raise ConfigError(f"app.snr_min/snr_max=({self.snr_min}, {self.snr_max}): need 0 < snr_min <= snr_max")
        if not 0 < self.signal_fraction < 1:
            raise ConfigError(f"app.signal_fraction={self.signal_fraction}: must be strictly between 0 and 1")
        if not 0 <= self.curriculum_fraction <= 1:
            raise ConfigError(f"app.curriculum_fraction={self.curriculum_fraction}: must be in [0, 1]")
        if self.segment < 4 * self.window:
            raise ConfigError(f"app.segment={self.segment}: must be at least 4 windows long")
        if len(self.channels) != 3 or min(self.channels) < 1:
            raise ConfigError(f"app.channels={self.channels}: give three positive channel counts, e.g. [16, 32, 64]")

    # The keys that shape the stored ensemble; the others (SNR range, training
    # mix, network width) act only at training time, so one test set serves them all.
    SIMULATION_KEYS = ("sample_rate", "window", "f_lower", "segment", "psd", "approximant", "detector",
                       "mass_min", "mass_max", "merger_min", "merger_max")

    def simulation_settings(self) -> dict:
        """The settings a stored ensemble depends on (see ``SIMULATION_KEYS``)."""
        return {k: getattr(self, k) for k in self.SIMULATION_KEYS}

    @property
    def window_samples(self) -> int:
        return int(round(self.window * self.sample_rate))

    @property
    def stored_samples(self) -> int:
        """Length of a stored whitened signal (window plus the merger-time range)."""
        return int(round((self.window + self.merger_max - self.merger_min) * self.sample_rate))

    @property
    def merger_index(self) -> int:
        """Index of the merger in a stored signal."""
        return int(round(self.merger_max * self.sample_rate))
