"""The report page: every section, table and embedded figure, nothing fetched from outside, "not measured yet"
for what is missing; and the Chromium screenshot, when Chromium is installed."""
import base64
import json
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from converge.bench import collectives, gemm, surrogate
from converge.bench.artifacts import pyplot, save_figure, write_json
from converge.bench.report import NOT_MEASURED, all_sections, render_png, result_files, write_report

CHROMIUM = Path("/usr/bin/chromium")


def small_png(path: Path, label: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot([0, 1], [0, 1], label=label)
    ax.legend()
    save_figure(fig, path)


def collectives_result() -> dict:
    rows = [{"op": op, "bytes": b, "count": b // 4, "seconds": 1e-4 * b / 8, "repeats": 3, "algbw_GBps": 1.0,
             "busbw_GBps": 1.0, "correct": op != "broadcast" or b == 8, "wrong_ranks": 0} for op in
            ("allreduce", "broadcast") for b in (8, 64)]
    return {"backend": "gloo", "device": "cpu", "world": 2, "dtype": "float32", "rows": rows,
            "summary": collectives.summarize(rows), "all_correct": False, "notes": ["a note"]}


def surrogate_result() -> dict:
    timing = {"seconds_per_sample": 1e-3, "calls": 3, "batch": 1}
    gw = surrogate.comparison("matched filter", "CNN", {**timing, "seconds_per_sample": 0.02},
                              {**timing, "seconds_per_sample": 0.01, "batch": 64}, timing,
                              {**timing, "seconds_per_sample": 1e-4, "batch": 256})
    gw |= {"trained": False, "accuracy": {"source": "gw.json", "cnn": {"1e-03": {"8": 0.9}},
                                          "matched_filter": {"1e-03": {"8": 0.98}}}}
    chem = surrogate.comparison("DFT", "ANI", {**timing, "seconds_per_sample": 3.0}, None, timing,
                                {**timing, "seconds_per_sample": 1e-4, "batch": 256})
    chem |= {"trained": True, "accuracy": {"source": None, "note": "no chem evaluation"}}
    return {"device": "cpu", "threads": 1, "apps": {"gw": gw, "chem": chem}}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """A results folder with every section but ddp, a GPU file in a subfolder and one unknown layout."""
    d = tmp_path_factory.mktemp("results")
    gemm.write_results(gemm.run_gemm_benchmark(gemm.GemmConfig(sizes=(32,), precisions=("fp32", "bf16"),
                                                               target_s=0.01)), d)
    (d / "gpu").mkdir()
    write_json(d / "gpu" / "gemm_gpu.json", json.loads((d / "gemm.json").read_text()))
    collectives.write_results(collectives_result(), d)
    surrogate.write_results(surrogate_result(), d)
    write_json(d / "serve.json", {"gw": {"precision": "bf16", "device": "cpu", "model_only_best":
                                         {"samples_per_s": 5000.0, "batch_size": 64}, "throughput_batched_best": 2000.0}})
    write_json(d / "serve_old.json", {"something": {"else": 1.5}})  # a layout the serve table does not know
    write_json(d / "precision.json", {"gw": {"fp32": {"samples_per_s": 900.0}, "bf16": {"samples_per_s": 1400.0},
                                             "speedup_bf16": 1.56}})
    eff = {"1e-02": {"6": 0.7, "8": 0.95}}
    write_json(d / "gw.json", {"n_noise": 1000, "n_templates": 8, "threads": 1, "speedup": 90.0,
                               "cnn": {"efficiency": eff, "seconds_per_strain_second": 1e-4},
                               "matched_filter": {"efficiency": eff, "seconds_per_strain_second": 1e-2}})
    write_json(d / "chem.json", {"ethanol": {"energy_mae_kcal_mol": 0.1, "level_of_theory": "B3LYP",
                                             "speed": {"dft_seconds_per_conformer": 8.0}, "speedup_single": 4000.0}})
    for name in ("serve.png", "gw_roc.png", "gw_efficiency.png", "chem_ethanol_parity.png", "precision.png"):
        small_png(d / name, name)
    return d


class Page(HTMLParser):
    """Sections by id, with their tables, images and text."""

    def __init__(self) -> None:
        super().__init__()
        self.sections: dict[str, dict] = {}
        self.current: dict | None = None
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append((tag, attrs))
        if tag == "section":
            self.current = self.sections.setdefault(attrs["id"], {"tables": 0, "images": [], "text": ""})
        elif self.current is not None and tag == "table":
            self.current["tables"] += 1
        elif self.current is not None and tag == "img":
            self.current["images"].append(attrs)

    def handle_data(self, data):
        if self.current is not None:
            self.current["text"] += data


def parse(path: Path) -> Page:
    page = Page()
    page.feed(path.read_text())
    return page


def test_report_has_every_section_table_and_embedded_figure(results, tmp_path):
    info = write_report(results, tmp_path / "report.html")
    page = parse(info.path)
    assert list(page.sections) == ["headline", "machine", *(s.key for s in all_sections())]
    assert "CPU" in page.sections["machine"]["text"] and page.sections["machine"]["tables"] == 1
    expected = {"headline": (1, 0), "gemm": (4, 1), "allreduce": (2, 1), "serve": (2, 1), "surrogate": (2, 1),
                "precision": (1, 1),
                "gw": (2, 2), "chem": (1, 1)}  # (tables, figures); gemm: CPU and GPU files, 2 tables each
    for key, (n_tables, n_images) in expected.items():
        section = page.sections[key]
        assert (section["tables"], len(section["images"])) == (n_tables, n_images), key
        assert NOT_MEASURED not in section["text"]
    assert page.sections["ddp"]["tables"] == 0 and NOT_MEASURED in page.sections["ddp"]["text"]
    assert info.files["ddp"] == [] and "gpu/gemm_gpu.json" in info.files["gemm"]
    assert "layout not recognised" in page.sections["serve"]["text"]
    assert "WRONG" in page.sections["allreduce"]["text"] and "note: a note" in page.sections["allreduce"]["text"]
    for section in page.sections.values():
        for img in section["images"]:
            prefix = "data:image/png;base64,"
            assert img["src"].startswith(prefix)
            data = base64.b64decode(img["src"][len(prefix):])
            assert data == (results / img["alt"]).read_bytes()
            assert int(img["width"]) > 0 and int(img["height"]) > 0


def test_report_is_self_contained(results, tmp_path):
    info = write_report(results, tmp_path / "report.html")
    page = parse(info.path)
    assert not [t for t, _ in page.tags if t in ("script", "link", "iframe", "object", "embed")]
    for _, attrs in page.tags:
        for name in ("src", "href"):
            value = attrs.get(name) or ""
            assert value.startswith(("data:", "#")) or not value, value
    assert "@import" not in info.path.read_text() and "url(" not in info.path.read_text()


def test_an_empty_results_folder_says_not_measured_everywhere(tmp_path):
    info = write_report(tmp_path, tmp_path / "report.html")
    page = parse(info.path)
    for section in ["headline", *(s.key for s in all_sections())]:
        assert NOT_MEASURED in page.sections[section]["text"]
    assert all(files == [] for files in info.files.values())


def test_unreadable_files_are_reported_not_fatal(tmp_path):
    (tmp_path / "gemm.json").write_text("{not json")
    (tmp_path / "gemm.png").write_bytes(b"not a png")
    page = parse(write_report(tmp_path, tmp_path / "report.html").path)
    assert page.sections["gemm"]["text"].count("unreadable") == 2


def test_result_files_match_stems_and_gpu_subfolders(tmp_path):
    for name in ("gemm.json", "gemm_gpu.json", "gemmx.json", "sub/gemm-gpu.json", "sub/deeper/gemm.json"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}")
    found = [str(p.relative_to(tmp_path)) for p in result_files(tmp_path, ("gemm",), "json")]
    assert found == ["gemm.json", "gemm_gpu.json", "sub/gemm-gpu.json"]


def test_render_png_needs_chromium(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install chromium"):
        render_png(tmp_path / "x.html", tmp_path / "x.png", chromium=str(tmp_path / "no-chromium"))


@pytest.mark.skipif(not CHROMIUM.is_file(), reason="Chromium is not installed at /usr/bin/chromium "
                                                   "(Debian: apt-get install chromium)")
def test_report_renders_to_a_non_blank_png(results, tmp_path):
    info = write_report(results, tmp_path / "report.html")
    png = render_png(info.path, tmp_path / "report.png")
    image = pyplot().imread(png)
    assert image.shape[1] == 1400 and image.shape[0] == min(info.estimated_height, 16_000)
    gray = image[..., :3].mean(axis=-1)
    assert gray.std() > 0.05  # text, tables and figures, not one flat colour
    assert np.mean(gray < 0.5) > 0.005  # dark pixels: text was drawn


def test_trust_and_peer_tables_carry_the_headline_numbers():
    from converge.apps.chem.report import trust_tables
    from converge.bench.report_tables import serve_tables

    trust = {"active": {"dft_calls": [8, 16], "test_mae": [1.5, 0.45], "calls_to_reach_random_final": 7.2,
                        "fraction_of_random_calls": 0.45}, "random": {"dft_calls": [8, 16], "test_mae": [1.5, 0.41]},
             "spread": {"by_seed": [], "gate_max_uncertainty_kcal_mol_per_sqrt_atom": 0.15, "in_distribution": {
                 "mean_energy_spread_per_atom_kcal_mol": 0.157, "ood_flagged_fraction": 0.01,
                 "routed_to_simulator_fraction": 0.02}}, "target": {"met": True}}
    curve, spread, target = trust_tables(trust)
    assert curve.header == ["strategy", "8", "16"] and curve.rows[0][0] == "active" and len(curve.rows) == 2
    assert spread.rows == [["in_distribution", "0.157", "1%", "2%"]]
    assert target.rows == [["0.41", "7.2", "45%", "yes"]]
    ours = {"format": "binary", "throughput": 3400.0, "p99_ms": 40.0, "gain": 0.97, "meets_target": False,
            "settings": {"max_batch_size": 64, "instances": 2}}
    rep = {"precision": "bf16", "device": "cpu", "model_only_best": {"samples_per_s": 6000.0, "batch_size": 64},
           "peers": {"triton": {"format": "binary", "throughput_best": 3510.0, "p99_ms_best": 47.4,
                                "settings_best": {"max_batch_size": 128, "workers": 2}, "ours_at_equal_p99": ours},
                     "mlserver": {"peer": "mlserver", "error": "its environment failed"}}}
    tables = serve_tables({"gw": rep})
    assert len(tables) == 2 and [row[:2] for row in tables[1].rows] == [["gw", "triton"], ["gw", "mlserver"]]
    assert tables[1].rows[0][3] == "max_batch_size 128, workers 2" and tables[1].rows[0][-3:] == [
        "max_batch_size 64, instances 2", "0.97", "no"]
    assert "its environment failed" in tables[1].rows[1][4]
    assert len(serve_tables({"gw": {k: v for k, v in rep.items() if k != "peers"}})) == 1
