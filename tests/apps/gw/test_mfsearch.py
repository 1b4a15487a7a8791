"""The matched-filter search: PyCBC's filter as reference, chunk independence, coincidence, cache, the search."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from converge.apps.gw import mfsearch
from converge.apps.gw.bank import write_bank
from converge.apps.gw.conditioning import Conditioning, whiten_strain_set
from converge.apps.gw.datafile import open_strain
from converge.apps.gw.events import read_events
from converge.apps.gw.fullbank import FULL_FIELDS, _plain, analytic_correlation
from converge.apps.gw.mfsearch import FilterConfig, TemplateSet, coincidences, detector_triggers
from converge.apps.gw.search import SearchConfig

from .conftest import FS, GPS0, NET


@pytest.fixture(scope="module")
def whitened(network_file, tmp_path_factory):
    return whiten_strain_set(open_strain(network_file), Conditioning(), tmp_path_factory.mktemp("w"), NET.network)


@pytest.fixture(scope="module")
def bank_file(tmp_path_factory, network_strain):
    masses = [[p["mass1"], p["mass2"]] for p in network_strain[1]] + [[40.0, 12.0], [15.0, 11.0]]
    path = tmp_path_factory.mktemp("b") / "bank.json"
    write_bank(path, NET, np.array(masses), 0.97, kind="full-length",
               population={k: _plain(getattr(NET, k)) for k in FULL_FIELDS})
    return path


def test_snr_series_agrees_with_pycbc_matched_filter(network_strain, whitened):
    """Our whitened-domain filter against pycbc.filter.matched_filter with the same Welch PSD, one template."""
    from pycbc.filter import matched_filter
    from pycbc.psd import interpolate
    from pycbc.types import FrequencySeries, TimeSeries

    from converge.apps.gw.fullbank import template_spectrum

    seg, inj = whitened[0], network_strain[1][0]
    det = max(("H1", "L1"), key=lambda d: inj[f"snr_{d}"])
    n_fft = 64 * FS
    ours = TemplateSet(NET, np.array([[inj["mass1"], inj["mass2"]]]), n_fft, "test")
    x = np.zeros(n_fft, np.float32)
    x[:] = seg.channels[det][16 * FS:16 * FS + n_fft]  # GPS0 + 16 .. GPS0 + 80
    z = analytic_correlation(torch.fft.rfft(torch.from_numpy(x)), ours.whitened(seg.fir[det]), n_fft)[0].abs()
    data = TimeSeries(network_strain[0][det][16 * FS:16 * FS + n_fft], delta_t=1 / FS)
    freqs, psd = seg.psd[det]
    psd = interpolate(FrequencySeries(psd, delta_f=freqs[1]), data.delta_f)
    tmpl = FrequencySeries(template_spectrum(NET, inj["mass1"], inj["mass2"], n_fft) / FS, delta_f=data.delta_f)
    ref = np.abs(matched_filter(tmpl, data, psd=psd, low_frequency_cutoff=20.0).numpy())
    from converge.apps.gw.waveforms import arrival_delay

    peak = int(round((inj["gps_time"] + arrival_delay(det, inj) - GPS0 - 16) * FS))
    window = slice(peak - FS // 2, peak + FS // 2)
    assert abs(int(np.argmax(ref[window])) - int(np.argmax(z[window].numpy()))) <= 1  # same merger sample
    assert z[window].max().item() == pytest.approx(ref[window].max(), rel=0.02)  # FIR truncation: < 2%
    assert np.corrcoef(z[window].numpy(), ref[window])[0, 1] > 0.995
    assert z[window].max().item() == pytest.approx(inj[f"snr_{det}"], rel=0.15)  # its optimal SNR, in noise


def sorted_triggers(t):
    order = np.lexsort((t["sample"], t["template"]))
    return {k: v[order] for k, v in t.items()}


def test_triggers_do_not_depend_on_how_the_segment_is_cut(whitened):
    seg = whitened[0]
    ts = TemplateSet(NET, np.array([[30.0, 25.0], [20.0, 14.0], [40.0, 12.0]]), 16 * FS, "x")
    fcfg = FilterConfig(fft_s=16.0, snr_threshold=4.0)  # 16 s blocks: each block gives a few seconds
    whole = sorted_triggers(detector_triggers(seg, "L1", ts, fcfg, *seg.valid))
    cut = seg.valid[0] + 29 * FS + 77  # pieces (as the cache makes them) and blocks start elsewhere
    parts = [detector_triggers(seg, "L1", ts, fcfg, seg.valid[0], cut), detector_triggers(seg, "L1", ts, fcfg, cut,
                                                                                          seg.valid[1])]
    pieces = sorted_triggers({k: np.concatenate([p[k] for p in parts]) for k in whole})
    for k in ("template", "sample"):
        np.testing.assert_array_equal(pieces[k], whole[k])
    np.testing.assert_allclose(pieces["snr"], whole["snr"], rtol=1e-5)
    assert len(whole["snr"]) > 2
    near = (whole["template"][:, None] == whole["template"][None]) & (
        np.abs(whole["sample"][:, None] - whole["sample"][None]) <= FS // 2)
    assert near.sum() == len(whole["snr"])  # one trigger per template within half a second: the clustering held
    # a longer FFT samples the templates more finely: the same triggers, SNRs within 1%
    longer = sorted_triggers(detector_triggers(seg, "L1", TemplateSet(NET, ts.masses, 32 * FS, "x"),
                                               FilterConfig(fft_s=32.0, snr_threshold=4.0), *seg.valid))
    np.testing.assert_array_equal(longer["sample"], whole["sample"])
    np.testing.assert_allclose(longer["snr"], whole["snr"], rtol=1e-2)


def test_coincidence_window():
    w = 25  # samples: light travel time plus margin at 2048 Hz
    h = {"template": np.array([0, 0, 1, 2], np.int32), "sample": np.array([1000, 5000, 9000, 12000]),
         "snr": np.array([6.0, 7.0, 8.0, 5.5], np.float32)}
    l = {"template": np.array([0, 0, 1, 2, 2], np.int32), "sample": np.array([1000 + w, 5000 - w - 1, 9000, 12010,
                                                                              11995]),
         "snr": np.array([5.0, 9.0, 6.0, 5.2, 6.5], np.float32)}
    c = coincidences(h, l, w)
    # t0: +25 inside (edge included); -26 outside; t1: same sample; t2: two partners, the louder (6.5) kept
    assert c["sample_h"].tolist() == [1000, 9000, 12000] and c["sample_l"].tolist() == [1025, 9000, 11995]
    np.testing.assert_allclose(c["stat"], np.hypot([6.0, 8.0, 5.5], [5.0, 6.0, 6.5]), rtol=1e-6)
    other = dict(l, template=np.array([1, 1, 0, 0, 0], np.int32))  # other templates never coincide
    assert len(coincidences(h, other, w)["stat"]) == 0


def test_search_finds_the_injections_and_resumes_from_its_cache(network_file, network_strain, bank_file,
                                                               tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    fcfg = FilterConfig(piece_s=40.0)
    summary = mfsearch.search_matched_filter(NET, network_file, tmp_path / "fg.hdf", SearchConfig(), fcfg,
                                             bank_file, cache, progress=False)
    events, attrs = read_events(tmp_path / "fg.hdf")
    assert attrs["method"] == "matched_filter" and summary["n_templates"] == 4
    for inj in network_strain[1]:
        near = np.abs(events["time"] - inj["gps_time"]) < 0.05
        assert near.sum() == 1 and events["stat"][near][0] > 15  # network SNR 25 injected
    assert len(list(cache.glob("*.npz"))) == 2 * 3  # 2 detectors x 3 pieces of 40 s

    def refuse(*args, **kwargs):
        raise AssertionError("the cache should have answered")

    monkeypatch.setattr(mfsearch, "detector_triggers", refuse)
    again = mfsearch.search_matched_filter(NET, network_file, tmp_path / "fg2.hdf", SearchConfig(), fcfg,
                                           bank_file, cache, progress=False)
    np.testing.assert_array_equal(read_events(tmp_path / "fg2.hdf")[0]["stat"], events["stat"])
    slid = mfsearch.search_matched_filter(NET, network_file, tmp_path / "bg.hdf", SearchConfig(slides=5), fcfg,
                                          bank_file, cache, progress=False)
    assert slid["background_s"] == pytest.approx(5 * again["analysed_s"])
    bg, _ = read_events(tmp_path / "bg.hdf")
    assert set(bg["slide"].tolist()) <= {1, 2, 3, 4, 5}
    assert bg["stat"].max(initial=0) < 15  # the injections do not coincide with themselves once slid


def test_follow_mode_matched_filter_finds_the_injections_as_files_land(network_file, network_strain, bank_file,
                                                                       tmp_path):
    import threading

    from converge.apps.gw.follow import feed_stretches, follow_matched_filter

    landing = tmp_path / "landing"
    feeder = threading.Thread(target=feed_stretches, args=(open_strain(network_file), landing, 4.0, 0.05))
    feeder.start()
    summary = follow_matched_filter(NET, landing, tmp_path / "live.hdf", SearchConfig(), FilterConfig(),
                                    bank_file, idle_timeout=2.0)
    feeder.join()
    events, _ = read_events(tmp_path / "live.hdf")
    for inj in network_strain[1]:
        near = np.abs(events["time"] - inj["gps_time"]) < 0.05
        assert near.sum() == 1 and events["stat"][near][0] > 15
    assert summary["latency_ms"]["n"] + summary["n_warmup_events"] >= 1 and summary["analysed_s"] == 96.0


def test_full_bank_placement_and_its_population_check(tmp_path):
    from converge.apps.gw.config import GWConfig
    from converge.apps.gw.fullbank import load_full_bank, place_full_bank

    cfg = GWConfig.mlgwsc1(1, mass_min=30.0, mass_max=33.0)
    masses = place_full_bank(cfg, min_match=0.97, seed=1, max_rejections=10)
    assert 1 <= len(masses) < 10 and np.all((masses >= 30.0) & (masses <= 33.0))
    assert np.all(masses[:, 0] >= masses[:, 1])
    write_bank(tmp_path / "b.json", cfg, masses, 0.97, kind="full-length",
               population={k: _plain(getattr(cfg, k)) for k in FULL_FIELDS})
    assert len(load_full_bank(cfg, tmp_path / "b.json")[0]) == len(masses)
    with pytest.raises(ValueError, match=r"placed for another population: mass_min=10\.0 \(bank: 30\.0\)"):
        load_full_bank(GWConfig.mlgwsc1(1), tmp_path / "b.json")
    with pytest.raises(ValueError, match="no full-length template bank"):
        load_full_bank(cfg, tmp_path / "none.json")
