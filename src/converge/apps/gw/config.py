"""Settings of the gravitational-wave app (the ``[app]`` table of a config file)."""
from __future__ import annotations

from dataclasses import dataclass

from ...config import ConfigError

DETECTORS = ("H1", "L1")  # the single-detector path
NETWORK_DETECTORS = ("H1", "L1", "V1")  # app.detectors
SPIN_MODELS = ("zero", "aligned", "isotropic")
MODES = (22, 21, 33, 32, 44)  # the (l, m) modes IMRPhenomXPHM's mode_array may name, written lm


@dataclass(frozen=True)
class GWConfig:
    """Physics and data-pipeline settings of the gw app.

    Times in seconds, frequencies in Hz, masses in solar masses (detector frame).
    A stored sample is the whitened detector response over
    ``window + merger_max - merger_min`` seconds with the merger at ``merger_max``
    seconds; the data pipeline crops a ``window`` at a random offset so the merger
    lands in [merger_min, merger_max] seconds of the window.

    Detectors: ``detectors`` empty (the default) is the single ``detector``, with the
    merger time taken at that detector (the app's original behaviour, unchanged).
    Two or more, e.g. ``("H1", "L1")``, project every waveform onto each of them with
    its antenna pattern and its arrival-time delay from the geocentre; the merger time
    is then the geocentric one (see ``waveforms``). Population: ``spins`` "zero",
    "aligned" (``spin1z, spin2z`` uniform in [-spin_max, spin_max]) or "isotropic"
    (magnitudes uniform in [0, spin_max], directions uniform on the sphere: precession);
    ``mode_array`` the modes of an IMRPhenomXPHM waveform (``(22,)``: the dominant mode
    only; empty: the approximant's default). Presets: :meth:`mlgwsc1`.
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
    # "valid": no zero padding in the CNN, so a search scores all the overlapping windows of a stretch from
    # one pass of the convolutions (DetectionCNN.stream; exact); "same": each window on its own
    conv_padding: str = "same"
    detectors: tuple[str, ...] = ()  # () -> (detector,); ("H1", "L1"): a coherent two-detector network
    spins: str = "zero"
    spin_max: float = 0.99
    mode_array: tuple[int, ...] = ()

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
        if self.conv_padding not in ("same", "valid"):
            raise ConfigError(f"app.conv_padding={self.conv_padding!r}: give 'same' or 'valid'")
        if len(self.channels) != 3 or min(self.channels) < 1:
            raise ConfigError(f"app.channels={self.channels}: give three positive channel counts, e.g. [16, 32, 64]")
        unknown = [d for d in self.detectors if d not in NETWORK_DETECTORS]
        if unknown or len(set(self.detectors)) != len(self.detectors):
            raise ConfigError(f"app.detectors={list(self.detectors)}: name each of "
                              f"{', '.join(NETWORK_DETECTORS)} at most once, e.g. [\"H1\", \"L1\"]")
        if self.spins not in SPIN_MODELS:
            raise ConfigError(f"app.spins={self.spins!r}: choose one of {', '.join(SPIN_MODELS)}")
        if not 0 <= self.spin_max < 1:
            raise ConfigError(f"app.spin_max={self.spin_max}: must be in [0, 1)")
        if any(m not in MODES for m in self.mode_array):
            raise ConfigError(f"app.mode_array={list(self.mode_array)}: modes are written lm, from {list(MODES)}")

    @classmethod
    def mlgwsc1(cls, dataset: int = 1, **overrides) -> "GWConfig":
        """The population of MLGWSC-1 dataset 1, 2 or 3 (Schäfer et al. 2023, PRD 107, 023021;
        ``ds1.ini``-``ds3.ini`` of the challenge), seen by H1 and L1 at 2048 Hz from 20 Hz.

        DS1: IMRPhenomXPHM, mode 22 only, masses uniform in [10, 50] Msun (``m2 <= m1``), no spins,
        aLIGOZeroDetHighPower noise. DS2: masses in [7, 50], aligned spins up to 0.99. DS3: masses in
        [7, 50], isotropic spins up to 0.99 (precession) and the modes 22, 21, 33, 32, 44.
        Without precession, XPHM's (2, 2) mode is IMRPhenomXAS (whitened unit-norm signals agree to
        2e-5, tested), which LALSuite makes 20x faster here; DS1 and DS2 therefore simulate XAS.
        DS2 and DS3 noise is coloured by the 20 PSDs per detector the challenge ships (``psds/``, here in
        ``data/mlgwsc1_psds.npz``): their presets set ``psd="mlgwsc1"``, so that each training signal is
        whitened by one of them per detector, drawn per sample; the search whitens with the data's own
        Welch PSD.
        """
        presets = {
            1: dict(mass_min=10.0, mass_max=50.0, spins="zero", approximant="IMRPhenomXAS"),
            2: dict(mass_min=7.0, mass_max=50.0, spins="aligned", approximant="IMRPhenomXAS", psd="mlgwsc1"),
            3: dict(mass_min=7.0, mass_max=50.0, spins="isotropic", approximant="IMRPhenomXPHM",
                    mode_array=(22, 21, 33, 32, 44), psd="mlgwsc1"),
        }
        if dataset not in presets:
            raise ConfigError(f"MLGWSC-1 dataset {dataset}: presets exist for 1, 2 and 3 (dataset 4 is real noise)")
        base = dict(sample_rate=2048, f_lower=20.0, psd="aLIGOZeroDetHighPower", detectors=("H1", "L1"),
                    spin_max=0.99)
        return cls(**{**base, **presets[dataset], **overrides})

    # The keys that shape the stored ensemble; the others (SNR range, training
    # mix, network width) act only at training time, so one test set serves them all.
    SIMULATION_KEYS = ("sample_rate", "window", "f_lower", "segment", "psd", "approximant", "detector",
                       "mass_min", "mass_max", "merger_min", "merger_max", "detectors", "spins", "spin_max",
                       "mode_array")

    def simulation_settings(self) -> dict:
        """The settings a stored ensemble depends on (see ``SIMULATION_KEYS``)."""
        return {k: getattr(self, k) for k in self.SIMULATION_KEYS}

    @property
    def network(self) -> tuple[str, ...]:
        """The detectors a sample is seen by, in channel order."""
        return self.detectors or (self.detector,)

    @property
    def coherent(self) -> bool:
        """Whether samples hold several detectors (a (D, T) array per sample, geocentric merger times)."""
        return len(self.network) > 1

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
