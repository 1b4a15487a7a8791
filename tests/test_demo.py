"""`converge demo --quick` runs both apps end to end (slow: about two minutes)."""
import json

import pytest

from converge.demo import run_demo


@pytest.mark.slow
def test_quick_demo_runs_both_apps(tmp_path):
    summary = run_demo(tmp_path, quick=True)
    assert set(summary) >= {"gw", "chem"}
    assert all(summary["gw"]["injections_found"])
    assert summary["chem"]["evaluation"]["speedup_batched"] > 1
    assert json.loads((tmp_path / "summary.json").read_text())["gw"]["n_templates"] > 100
    assert (tmp_path / "gw" / "efficiency.png").exists() and (tmp_path / "chem" / "run" / "parity.png").exists()
