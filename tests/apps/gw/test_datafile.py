"""Readers of continuous strain in both layouts (MLGWSC-1 and GWOSC), and every clear error."""
from __future__ import annotations

import h5py
import numpy as np
import pytest

from converge.apps.gw.datafile import open_strain, write_mlgwsc1
from converge.apps.gw.search import check_data
from converge.apps.gw.strainfile import Strain, StrainFileError, write_strain

FS = 256.0
GPS = 1_238_166_018.0


def series(n, seed):
    return np.random.default_rng(seed).normal(size=n)


def gwosc(folder, det, gps, data, rate=FS):
    path = folder / f"{det[0]}-{det}_TEST-{gps:.0f}-{len(data) / rate:g}.hdf5"
    write_strain(path, Strain(data, rate, gps, det))
    return path


def test_mlgwsc1_layout_reads_segments_per_detector_in_chunks(tmp_path):
    a = {d: series(256 * 40, k) for k, d in enumerate(("H1", "L1"))}
    b = {d: series(256 * 20, k + 5) for k, d in enumerate(("H1", "L1"))}
    write_mlgwsc1(tmp_path / "d.hdf", [(GPS + 100, b), (GPS, a)], FS)
    data = open_strain(tmp_path / "d.hdf")
    assert data.layout == "mlgwsc1" and data.detectors == ("H1", "L1") and data.sample_rate == FS
    assert [s.start for s in data.segments] == [GPS, GPS + 100] and data.duration == 60.0
    np.testing.assert_array_equal(data.read(0, "L1", 300, 900), a["L1"][300:900])
    np.testing.assert_array_equal(data.read(1, "H1", 0, 256 * 20), b["H1"])
    with h5py.File(tmp_path / "d.hdf") as f:  # the challenge's own attributes
        assert f["H1/1238166018"].attrs["delta_t"] == 1 / FS and f["H1/1238166018"].attrs["start_time"] == GPS


def test_gwosc_files_are_matched_by_gps_time(tmp_path):
    for k, gps in enumerate((GPS, GPS + 64)):
        for j, det in enumerate(("L1", "H1")):
            gwosc(tmp_path, det, gps, series(256 * 32, 10 * k + j))
    data = open_strain(tmp_path)  # a folder of them
    assert data.layout == "gwosc" and data.detectors == ("H1", "L1")
    assert [s.start for s in data.segments] == [GPS, GPS + 64]
    np.testing.assert_array_equal(data.read(1, "L1", 0, 10), series(256 * 32, 10)[:10])
    same = open_strain(sorted(tmp_path.glob("*.hdf5")))  # or the files themselves
    assert [s.sources for s in same.segments] == [s.sources for s in data.segments]


def test_gaps_are_refused_with_their_gps_time(tmp_path):
    h = series(256 * 40, 1)
    h[256 * 10 + 3] = np.nan
    write_mlgwsc1(tmp_path / "d.hdf", [(GPS, {"H1": h, "L1": series(256 * 40, 2)})], FS)
    data = open_strain(tmp_path / "d.hdf")
    data.read(0, "H1", 0, 256 * 10)  # the chunk before the gap is fine
    with pytest.raises(StrainFileError, match=r"H1 has 1 NaN/inf samples \(a data gap\).*the first at GPS "
                                              r"1238166028\.012"):
        data.read(0, "H1", 256 * 8, 256 * 12)


def test_read_into_an_array_converts_and_still_refuses_gaps(tmp_path):
    """A segment read straight into float32 memory (the CNN search's copy) holds the file's samples; NaN and inf
    are still a gap; an array of the wrong shape or layout is refused."""
    h = series(256 * 40, 3)
    h[256 * 30] = np.inf
    write_mlgwsc1(tmp_path / "d.hdf", [(GPS, {"H1": h, "L1": series(256 * 40, 4)})], FS)
    data = open_strain(tmp_path / "d.hdf")
    into = np.empty(256 * 20, np.float32)
    assert data.read(0, "H1", 256, 256 * 21, into) is into
    np.testing.assert_array_equal(into, h[256:256 * 21].astype(np.float32))
    with pytest.raises(StrainFileError, match=r"H1 has 1 NaN/inf samples \(a data gap\).*GPS 1238166048\.000"):
        data.read(0, "H1", 256 * 25, 256 * 35, np.empty(256 * 10, np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        data.read(0, "L1", 0, 100, np.empty(200)[::2])
    with pytest.raises(ValueError, match=r"give a C-contiguous \(100,\) one"):
        data.read(0, "L1", 0, 100, np.empty(99))


def test_mismatched_sample_rates_are_refused(tmp_path):
    gwosc(tmp_path, "H1", GPS, series(256 * 32, 1))
    gwosc(tmp_path, "L1", GPS, series(256 * 32, 2), rate=512.0)  # as many samples, at another rate
    with pytest.raises(StrainFileError, match=r"GPS 1238166018: mismatched sample rates \(.*H-H1_TEST.* at 256 Hz, "
                                              r".*L-L1_TEST.* at 512 Hz\); resample"):
        open_strain(tmp_path)
    with h5py.File(tmp_path / "c.hdf", "w") as f:
        for det, dt in (("H1", 1 / 256), ("L1", 1 / 512)):
            ds = f.create_dataset(f"{det}/1238166018", data=np.zeros(256 * 32))
            ds.attrs["start_time"], ds.attrs["delta_t"] = GPS, dt
    with pytest.raises(StrainFileError, match=r"mismatched sample rates \(H1 at 256 Hz, L1 at 512 Hz\)"):
        open_strain(tmp_path / "c.hdf")


def test_mismatched_detectors_are_refused(tmp_path):
    write_mlgwsc1(tmp_path / "d.hdf", [(GPS, {"H1": series(256 * 32, 1), "L1": series(256 * 32, 2)}),
                                       (GPS + 64, {"H1": series(256 * 32, 3)})], FS)
    with pytest.raises(StrainFileError, match="segment at GPS 1238166082 is in H1 but not in L1: mismatched"):
        open_strain(tmp_path / "d.hdf")
    gwosc(tmp_path, "H1", GPS, series(256 * 32, 1))
    gwosc(tmp_path, "L1", GPS + 32, series(256 * 32, 2))
    with pytest.raises(StrainFileError, match="no L1 file for GPS 1238166018"):
        open_strain(sorted(tmp_path.glob("*.hdf5")))
    write_mlgwsc1(tmp_path / "h.hdf", [(GPS, {"H1": series(256 * 32, 1), "V1": series(256 * 32, 2)})], FS)
    with pytest.raises(StrainFileError, match="needs detectors H1, L1, but the data holds H1, V1"):
        check_data(open_strain(tmp_path / "h.hdf"), ("H1", "L1"), FS, 16.0, "the run")


def test_too_short_segments_and_wrong_rate_for_the_search(tmp_path):
    write_mlgwsc1(tmp_path / "d.hdf", [(GPS, {"H1": series(256 * 10, 1), "L1": series(256 * 10, 2)})], FS)
    data = open_strain(tmp_path / "d.hdf")
    with pytest.raises(StrainFileError, match="lasts 10 s, shorter than the 16 s needed"):
        check_data(data, ("H1", "L1"), FS, 16.0, "the run")
    with pytest.raises(StrainFileError, match="sampled at 256 Hz but the run works at 2048 Hz; resample"):
        check_data(data, ("H1", "L1"), 2048.0, 8.0, "the run")


def test_other_files_are_refused(tmp_path):
    (tmp_path / "x.hdf").write_text("hello")
    with pytest.raises(StrainFileError, match="not an HDF5 file"):
        open_strain(tmp_path / "x.hdf")
    with h5py.File(tmp_path / "y.hdf", "w") as f:
        f["numbers"] = np.zeros(3)
    with pytest.raises(StrainFileError, match="neither the GWOSC layout"):
        open_strain(tmp_path / "y.hdf")
    with pytest.raises(StrainFileError, match="no such file or directory"):
        open_strain(tmp_path / "none.hdf")
    with pytest.raises(StrainFileError, match="no HDF5 files"):
        open_strain((tmp_path / "empty").mkdir() or tmp_path / "empty")
