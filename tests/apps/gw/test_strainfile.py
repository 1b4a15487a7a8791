"""GWOSC-layout strain files: round trip and every clear error."""
import h5py
import numpy as np
import pytest

from converge.apps.gw.strainfile import Strain, StrainFileError, read_strain, write_strain


def good(tmp_path, data=None):
    data = np.random.default_rng(0).normal(size=2048 * 8) if data is None else data
    write_strain(tmp_path / "s.hdf5", Strain(data, 2048.0, 1_000_000_000.0, "H1"))
    return tmp_path / "s.hdf5"


def test_round_trip(tmp_path):
    s = read_strain(good(tmp_path))
    assert s.sample_rate == 2048.0 and s.gps_start == 1e9 and s.detector == "H1" and len(s.data) == 2048 * 8


def test_missing_file_and_non_hdf5(tmp_path):
    with pytest.raises(StrainFileError, match="no such file"):
        read_strain(tmp_path / "none.hdf5")
    (tmp_path / "x.hdf5").write_text("hello")
    with pytest.raises(StrainFileError, match="not an HDF5 file"):
        read_strain(tmp_path / "x.hdf5")


def test_missing_dataset(tmp_path):
    with h5py.File(tmp_path / "e.hdf5", "w") as f:
        f["meta/GPSstart"] = 0.0
    with pytest.raises(StrainFileError, match="no 'strain/Strain' dataset"):
        read_strain(tmp_path / "e.hdf5")


def test_nans_are_a_gap_with_its_gps_time(tmp_path):
    data = np.random.default_rng(0).normal(size=2048 * 8)
    data[2048 * 3:2048 * 4] = np.nan
    with pytest.raises(StrainFileError, match=r"2048 NaN/inf samples \(a data gap\), the first at GPS 1000000003.000"):
        read_strain(good(tmp_path, data))


def test_truncated_file_disagrees_with_duration(tmp_path):
    path = good(tmp_path)
    with h5py.File(path, "a") as f:
        del f["meta/Duration"]
        f["meta/Duration"] = 16.0
    with pytest.raises(StrainFileError, match="gap or is truncated"):
        read_strain(path)
