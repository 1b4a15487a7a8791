"""Config loading: unknown keys and bad values are refused, naming the key."""
import pytest

from converge.apps.gw.config import GWConfig
from converge.config import (ConfigError, check_sections, dump_json, from_dict, load_section, parse_overrides,
                             read_toml)
from converge.train.loop import TrainConfig


def test_toml_round_trip_and_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[app]\nmass_min = 10.0\nchannels = [8, 16, 32]\n[train]\nepochs = 3\nprecision = "fp32"\n')
    tables = read_toml(path)
    ov = parse_overrides(["train.lr=0.01", "app.detector=L1"])
    app = load_section(GWConfig, tables, "app", ov["app"])
    train = load_section(TrainConfig, tables, "train", {**ov["train"], "epochs": None})
    assert app.mass_min == 10.0 and app.channels == (8, 16, 32) and app.detector == "L1"
    assert train.epochs == 3 and train.lr == 0.01 and train.precision == "fp32"
    assert from_dict(GWConfig, __import__("json").loads(dump_json(app))) == app


def test_unknown_key_names_the_key_and_the_valid_ones():
    with pytest.raises(ConfigError, match=r"unknown key train\.learning_rate.*valid keys.*\blr\b"):
        from_dict(TrainConfig, {"learning_rate": 1e-3}, "train")


def test_unknown_section_is_refused():
    with pytest.raises(ConfigError, match=r"unknown section \[trian\]"):
        check_sections({"trian": {}}, {"train", "app"})


@pytest.mark.parametrize("section,cls,data,message", [
    ("train", TrainConfig, {"precision": "fp8"}, r"train\.precision=.fp8.: choose one of auto, bf16, fp16, fp32"),
    ("train", TrainConfig, {"epochs": "many"}, r"train\.epochs: expected an integer"),
    ("train", TrainConfig, {"epochs": 0}, r"train\.epochs=0: must be >= 1"),
    ("app", GWConfig, {"detector": "V1"}, r"app\.detector='V1': choose one of H1, L1"),
    ("app", GWConfig, {"mass_min": 50.0, "mass_max": 20.0}, r"app\.mass_min/mass_max"),
    ("app", GWConfig, {"sample_rate": 1000}, r"app\.sample_rate=1000"),
])
def test_invalid_values_name_key_and_fix(section, cls, data, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(cls, data, section)


def test_bad_toml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        read_toml(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nepochs = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        read_toml(bad)
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_overrides(["lr=3"])
