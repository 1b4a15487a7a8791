"""The CNN search over continuous two-detector strain: events, chunking, slides, FAR, follow mode, errors."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from typer.testing import CliRunner

from converge import cli as cli_module
from converge.apps.gw.datafile import open_strain, write_mlgwsc1
from converge.apps.gw.events import read_events, write_events
from converge.apps.gw.search import SearchConfig, add_far, default_var, search_cnn, windows_to_events
from converge.apps.gw.timing import measure_timing, write_timing

from .conftest import FS, GPS0, NET

LOW = SearchConfig(threshold=-3.0)  # an untrained network: a low threshold so that there are events


def test_events_file_and_summary(tiny_run, network_file, tmp_path):
    summary = search_cnn(tiny_run, network_file, tmp_path / "ev.hdf", LOW, progress=False)
    events, attrs = read_events(tmp_path / "ev.hdf")
    assert set(events) >= {"time", "stat", "var", "slide"} and len(events["time"]) == summary["n_events"] > 0
    assert np.all(events["var"] == default_var(NET, LOW)) and attrs["kind"] == "foreground"
    assert summary["analysed_s"] == pytest.approx(96.0 - 4.0, abs=1e-3)  # 2 s at each end feed the filter
    assert (tmp_path / "ev.json").is_file() and np.all(np.diff(events["time"]) > LOW.cluster_s)


def test_chunked_search_equals_whole_file_search(tiny_run, network_file, tmp_path):
    a = search_cnn(tiny_run, network_file, tmp_path / "a.hdf", SearchConfig(threshold=-3.0, chunk_s=7.0),
                   progress=False)
    b = search_cnn(tiny_run, network_file, tmp_path / "b.hdf", SearchConfig(threshold=-3.0, chunk_s=96.0),
                   progress=False)
    ea, eb = read_events(tmp_path / "a.hdf")[0], read_events(tmp_path / "b.hdf")[0]
    assert a["n_events"] == b["n_events"]
    np.testing.assert_allclose(ea["time"], eb["time"], atol=1e-9)
    np.testing.assert_allclose(ea["stat"], eb["stat"], atol=1e-5)


def test_a_streaming_network_gives_the_events_of_window_by_window_scoring(tiny_streaming_run, network_file,
                                                                         tmp_path, monkeypatch):
    from converge.apps.gw.model import DetectionCNN

    cfg = SearchConfig(threshold=-3.0, slides=2, slide_step=2.0)
    streamed = search_cnn(tiny_streaming_run, network_file, tmp_path / "s.hdf", cfg, progress=False)
    monkeypatch.setattr(DetectionCNN, "streamable", property(lambda self: False))  # window by window
    windows = search_cnn(tiny_streaming_run, network_file, tmp_path / "w.hdf", cfg, progress=False)
    es, ew = read_events(tmp_path / "s.hdf")[0], read_events(tmp_path / "w.hdf")[0]
    assert streamed["n_events"] == windows["n_events"] > 0
    np.testing.assert_allclose(es["time"], ew["time"], atol=1e-9)
    np.testing.assert_allclose(es["stat"], ew["stat"], atol=1e-4)
    np.testing.assert_array_equal(es["slide"], ew["slide"])


def test_slides_are_background_only_and_give_n_times_the_time(tiny_run, network_file, tmp_path):
    fg = search_cnn(tiny_run, network_file, tmp_path / "fg.hdf", LOW, progress=False)
    bg = search_cnn(tiny_run, network_file, tmp_path / "bg.hdf", SearchConfig(threshold=-3.0, slides=4),
                    progress=False)
    events, attrs = read_events(tmp_path / "bg.hdf")
    assert bg["background_s"] == pytest.approx(4 * fg["analysed_s"]) == attrs["background_s"]
    assert set(events["slide"].tolist()) <= {1, 2, 3, 4} and attrs["kind"] == "background"
    add_far(tmp_path / "fg.hdf", tmp_path / "bg.hdf")
    fg_events, fg_attrs = read_events(tmp_path / "fg.hdf")
    louder = [(events["stat"] >= x).sum() for x in fg_events["stat"]]
    np.testing.assert_allclose(fg_events["far_per_month"], np.array(louder) / bg["background_s"] * 2_592_000)
    assert fg_attrs["far_background_s"] == bg["background_s"]


def test_background_in_groups_of_slides_merges_into_one(tiny_run, network_file, tmp_path):
    from converge.apps.gw.events import merge_backgrounds

    one = search_cnn(tiny_run, network_file, tmp_path / "all.hdf", SearchConfig(threshold=-3.0, slides=5),
                     progress=False)
    for first, n in ((1, 2), (3, 3)):
        search_cnn(tiny_run, network_file, tmp_path / f"g{first}.hdf",
                   SearchConfig(threshold=-3.0, slides=n, first_slide=first), progress=False)
    attrs = merge_backgrounds([tmp_path / "g1.hdf", tmp_path / "g3.hdf"], tmp_path / "merged.hdf")
    merged, whole = read_events(tmp_path / "merged.hdf")[0], read_events(tmp_path / "all.hdf")[0]
    assert attrs["background_s"] == pytest.approx(one["background_s"]) and attrs["slides"] == 5
    for name in ("slide", "time", "stat"):
        np.testing.assert_allclose(merged[name], whole[name], atol=1e-6)
    with pytest.raises(ValueError, match="overlap: the same slide would be counted twice"):
        merge_backgrounds([tmp_path / "g1.hdf", tmp_path / "g1.hdf"], tmp_path / "bad.hdf")


def test_cluster_times_use_the_loud_windows():
    starts = np.array([10.0, 10.125, 10.25, 10.375, 20.0])
    logits = np.array([0.5, 4.0, 4.2, 0.2, 3.0])
    times, stats = windows_to_events(starts, logits, 0.0, 1.0, 0.7)
    np.testing.assert_allclose(times, [10.1875 + 0.7, 20.7])  # windows above (peak + threshold) / 2 only
    np.testing.assert_allclose(stats, [4.2, 3.0])


def test_measured_timing_sets_offset_and_var(tiny_run, network_file, tmp_path):
    rng = np.random.default_rng(0)
    tc = 1e9 + 24 * np.arange(100.0)
    err = 0.05 + 0.01 * rng.standard_normal(100)
    record = measure_timing(tc + err, np.full(100, 5.0), tc, stat_floor=1.0)
    assert record["offset_s"] == pytest.approx(0.05, abs=0.005) and 0.015 < record["var_s"] < 0.04
    write_timing(tiny_run, record)
    search_cnn(tiny_run, network_file, tmp_path / "ev.hdf", LOW, progress=False)
    events, attrs = read_events(tmp_path / "ev.hdf")
    assert np.all(events["var"] == record["var_s"]) and attrs["timing_offset_s"] == record["offset_s"]
    (tiny_run / "timing.json").unlink()
    with pytest.raises(ValueError, match="only 0 injections found"):
        measure_timing(tc + 5.0, np.ones(100), tc, stat_floor=0.0)


def loud_logit(run, path, tmp_path, quantile=0.97):
    """A threshold the untrained network's logits cross now and then (so that events open and close)."""
    from converge.apps.gw.conditioning import Conditioning, whiten_strain_set
    from converge.apps.gw.search import score_segment
    from converge.train.loop import load_model
    from converge.apps.gw.app import GWApp

    model, _ = load_model(GWApp(), run)
    seg = whiten_strain_set(open_strain(path), Conditioning(), tmp_path / "w", NET.network)[0]
    return float(np.quantile(score_segment(model, NET, seg, SearchConfig(), 0)[1], quantile))


def test_follow_mode_writes_events_as_files_land_with_their_latency(tiny_run, network_file, tmp_path):
    from converge.apps.gw.follow import feed_stretches, follow_cnn

    landing = tmp_path / "landing"
    feeder = threading.Thread(target=feed_stretches, args=(open_strain(network_file), landing, 4.0, 0.05))
    feeder.start()
    summary = follow_cnn(tiny_run, landing, tmp_path / "live.hdf", SearchConfig(threshold=loud_logit(tiny_run,
                         network_file, tmp_path)), idle_timeout=2.0)
    feeder.join()
    events, attrs = read_events(tmp_path / "live.hdf")
    assert summary["analysed_s"] == 96.0 and attrs["follow"] == 1 and len(events["time"]) == summary["n_events"] > 0
    steady = np.isfinite(events["latency_s"]) & (events["warmup"] == 0)  # after the step that set the PSD
    latency = events["latency_s"][steady]
    assert len(latency) == summary["latency_ms"]["n"] > 0 and np.all((latency > 0) & (latency < 30))
    assert summary["latency_ms"]["p99"] >= summary["latency_ms"]["p50"] > 0
    assert summary["n_warmup_events"] == int(events["warmup"].sum()) and 0 < summary["busy_fraction"] < 1


def search_cli(*args):
    return CliRunner().invoke(cli_module.cli, ["search", "gw", *map(str, args), "--no-progress"])


def test_cli_searches_and_adds_far(tiny_run, network_file, tmp_path):
    result = search_cli(network_file, "--run", tiny_run, "--out", tmp_path / "bg.hdf", "--slides", 2,
                        "--threshold", -3)
    assert result.exit_code == 0, result.output
    result = search_cli(network_file, "--run", tiny_run, "--out", tmp_path / "fg.hdf", "--threshold", -3,
                        "--background", tmp_path / "bg.hdf")
    assert result.exit_code == 0, result.output
    assert "far_per_year" in read_events(tmp_path / "fg.hdf")[0]


def _file(tmp_path, name, detectors=("H1", "L1"), seconds=40.0, rate=FS, gap=False):
    rng = np.random.default_rng(0)
    data = {d: rng.normal(size=int(seconds * rate)) for d in detectors}
    if gap:
        data["L1"][int(20 * rate)] = np.nan
    write_mlgwsc1(tmp_path / name, [(GPS0, data)], rate)
    return tmp_path / name


@pytest.mark.parametrize("make, message", [
    (lambda p: _file(p, "v.hdf", ("H1", "V1")), "needs detectors H1, L1, but the data holds H1, V1: mismatched"),
    (lambda p: _file(p, "r.hdf", rate=1024), "sampled at 1024 Hz but the run .* works at 2048 Hz"),
    (lambda p: _file(p, "s.hdf", seconds=8.0), "lasts 8 s, shorter than the 16 s needed"),
    (lambda p: _file(p, "g.hdf", gap=True), r"L1 has 1 NaN/inf samples \(a data gap\)"),
])
def test_cli_error_paths(tiny_run, tmp_path, make, message):
    result = search_cli(make(tmp_path), "--run", tiny_run, "--out", tmp_path / "ev.hdf")
    assert result.exit_code == 2 and "error" in result.output
    assert __import__("re").search(message, " ".join(result.output.split())), result.output


def test_cli_option_errors(tiny_run, network_file, tmp_path):
    out = tmp_path / "ev.hdf"
    cases = [((network_file, "--out", out), "the CNN search needs --run RUN"),
             (("--out", out, "--run", tiny_run), "give the DATA to search, or --follow DIR"),
             ((network_file, "--out", out, "--method", "magic"), "--method 'magic': choose cnn or matched-filter"),
             ((network_file, "--out", out, "--method", "matched-filter"), "needs its population: --run RUN or "
                                                                         "--dataset 1"),
             ((network_file, "--run", tiny_run, "--out", out, "--slides", 1, "--slide-step", 0.5),
              "slide step 0.5 s is too short"),
             ((network_file, "--run", tiny_run, "--out", out, "--slides", 100, "--slide-step", 1.5),
              "slides up to 100 of 3072 samples need"),
             ((network_file, "--run", tiny_run, "--out", out, "--background", network_file), "not an events file")]
    for args, message in cases:
        result = search_cli(*args)
        assert result.exit_code == 2 and message in " ".join(result.output.split()), (args, result.output)


def test_background_of_another_method_is_refused(tmp_path):
    cols = {"time": np.zeros(1), "stat": np.zeros(1), "var": np.zeros(1)}
    write_events(tmp_path / "fg.hdf", cols, {"method": "cnn"})
    write_events(tmp_path / "bg.hdf", cols, {"method": "matched_filter", "background_s": 10.0})
    with pytest.raises(ValueError, match="rank events against their own method's background"):
        add_far(tmp_path / "fg.hdf", tmp_path / "bg.hdf")
    with pytest.raises(ValueError, match="events need"):
        write_events(tmp_path / "x.hdf", {"time": np.zeros(2), "stat": np.zeros(1), "var": np.zeros(1)})


def test_gwosc_files_give_the_same_events_as_the_challenge_layout(tiny_run, network_file, network_strain, tmp_path):
    from converge.apps.gw.strainfile import Strain, write_strain

    folder = tmp_path / "gwosc"
    folder.mkdir()
    for det, data in network_strain[0].items():  # one GWOSC file per detector
        write_strain(folder / f"{det[0]}-{det}_TEST-{GPS0:.0f}-96.hdf5", Strain(data, float(FS), GPS0, det))
    search_cnn(tiny_run, network_file, tmp_path / "a.hdf", LOW, progress=False)
    search_cnn(tiny_run, folder, tmp_path / "b.hdf", LOW, progress=False)
    a, b = read_events(tmp_path / "a.hdf")[0], read_events(tmp_path / "b.hdf")[0]
    np.testing.assert_array_equal(a["time"], b["time"])
    np.testing.assert_array_equal(a["stat"], b["stat"])
