"""Ours against the hardest peer, loaded in turn (bench.head_to_head): the per-round gain, its median, and the
alternation against two real servers."""
import json
from dataclasses import asdict

import pytest

from converge.apps.gw.app import GWApp
from converge.apps.gw.config import GWConfig
from converge.bench.head_to_head import cpu_split, load_in_turn, round_gain, summarize
from converge.bench.loadgen import InferTarget, LoadProcess
from converge.bench.serve import example_inputs
from converge.bench.server_process import ServerProcess
from converge.train.checkpoint import save_checkpoint

TINY = GWConfig(channels=(4, 4, 8), hidden=8)


def row(server, k, concurrency, sps, p99, errors=0):
    return {"round": k, "server": server, "concurrency": concurrency, "throughput_sps": sps, "p99_ms": p99,
            "errors": errors, "requests": 0 if errors and not sps else 10}


def test_round_gain_is_ours_at_a_p99_no_worse_than_the_peers_best_over_its_best():
    peer = [row("p", 0, 64, 5000.0, 30.0), row("p", 0, 128, 5500.0, 50.0)]
    ours = [row("c", 0, 64, 4800.0, 25.0), row("c", 0, 128, 6000.0, 49.0)]
    assert round_gain(ours, peer) == pytest.approx(6000 / 5500)
    # ours faster only at a worse p99: that point does not count
    slow_tail = [row("c", 0, 64, 4800.0, 25.0), row("c", 0, 128, 6000.0, 51.0)]
    assert round_gain(slow_tail, peer) == pytest.approx(4800 / 5500)
    # a row with errors is not clean, whatever its throughput
    assert round_gain([row("c", 0, 64, 9000.0, 10.0, errors=3)], peer) == 0.0
    assert round_gain(ours, [row("p", 0, 64, 0.0, None, errors=5)]) is None


def test_the_median_over_rounds_is_the_figure_and_judges_the_target():
    rows = []
    for k, (ours, theirs) in enumerate([(5000, 5000), (5500, 5000), (4000, 5000), (6000, 5000)]):
        rows += [row("converge", k, 64, ours, 30.0), row("triton", k, 64, theirs, 30.0)]
    out = summarize(rows, "converge", "triton", 1.0)
    assert out["gain_per_round"] == pytest.approx([1.0, 1.1, 0.8, 1.2])
    assert out["gain_median"] == pytest.approx(1.05) and out["meets_target"]
    assert out["gain_min"] == pytest.approx(0.8) and out["gain_max"] == pytest.approx(1.2)
    assert out["throughput_best_median"] == {"converge": 5250.0, "triton": 5000.0}
    assert not summarize(rows, "converge", "triton", 1.1)["meets_target"]


def test_two_real_servers_are_loaded_in_turn_and_the_idle_one_stays_idle(tmp_path):
    run = tmp_path / "gw-tiny"
    run.mkdir()
    config = {"app": "gw", "app_config": asdict(TINY), "train": {"precision": "fp32"}}
    (run / "config.json").write_text(json.dumps(config))
    save_checkpoint(run / "best.pt", {"model": GWApp().make_model(TINY).state_dict(), "config": config})
    strain = example_inputs("gw", TINY, 3)["strain"]
    samples = [{"strain": strain[i:i + 1]} for i in range(3)]
    with ServerProcess(run, "gw", 64, tmp_path / "a.log", startup_timeout_s=60) as a, \
            ServerProcess(run, "gw", 64, tmp_path / "b.log", startup_timeout_s=60) as b, LoadProcess() as load:
        targets = {name: InferTarget.from_inputs(s.url, "gw", samples) for name, s in (("a", a), ("b", b))}
        rows = load_in_turn(load, targets, {"a": a.cpu_seconds, "b": b.cpu_seconds}, (1, 2), 2, 0.4, 0.1, 10.0,
                            front={"a": a.front_cpu_seconds})
    assert [(r["round"], r["concurrency"], r["server"]) for r in rows] == [
        (0, 1, "a"), (0, 1, "b"), (0, 2, "a"), (0, 2, "b"), (1, 1, "b"), (1, 1, "a"), (1, 2, "b"), (1, 2, "a")]
    assert all(r["errors"] == 0 and r["requests"] > 0 and r["server_cpu_us_per_sample"] > 0 for r in rows)
    # the server not being loaded used next to no CPU in that window
    assert all(set(r["cpu_share_of_others"]) == {"b" if r["server"] == "a" else "a"} for r in rows)
    assert max(share for r in rows for share in r["cpu_share_of_others"].values()) < 0.3
    out = summarize(rows, "a", "b", 1.0)  # two like servers: either may win a round, by chance
    assert out["gain_per_round"] == [round_gain([r for r in rows if r["round"] == k and r["server"] == "a"],
                                                [r for r in rows if r["round"] == k and r["server"] == "b"])
                                     for k in (0, 1)]
    assert all(g >= 0 for g in out["gain_per_round"])
    # a's CPU split in its front end (the HTTP server's own process) and its model process; b had no split
    for r in rows:
        if r["server"] == "a":
            assert r["front_cpu_us_per_sample"] > 0 and r["workers_cpu_us_per_sample"] > 0
            assert r["front_cpu_us_per_sample"] + r["workers_cpu_us_per_sample"] == pytest.approx(
                r["server_cpu_us_per_sample"])
        else:
            assert "front_cpu_us_per_sample" not in r
    split = cpu_split(rows, "a")
    assert split["front_cpu_us_per_sample_range"][0] <= split["front_cpu_us_per_sample_median"] \
        <= split["front_cpu_us_per_sample_range"][1]
    assert cpu_split(rows, "b") is None


def test_triton_settings_are_read_from_the_command_line_or_a_report():
    from converge.bench.head_to_head import parse_triton_settings
    from converge.bench.peer_settings import PeerSettings

    assert parse_triton_settings("128:1:2") == PeerSettings(128, 1.0, 2)
    assert parse_triton_settings({"max_batch_size": 64, "delay_ms": 0.0, "workers": 1}) == PeerSettings(64, 0.0, 1)
    for bad in ("128:1", "128:x:2", "128:1:2:3", ""):
        with pytest.raises(ValueError, match="give BATCH:DELAY_MS:INSTANCES"):
            parse_triton_settings(bad)


def test_the_duel_alone_refuses_a_set_up_the_serve_bench_does_not_have(tmp_path):
    from converge.bench.head_to_head import duel_alone

    with pytest.raises(ValueError, match="ours='unbatched': choose a batched mode of the serve bench: batched, "):
        duel_alone(tmp_path, "unbatched", "64:0:1")
