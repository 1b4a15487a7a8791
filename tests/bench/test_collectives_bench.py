"""Collectives: the nccl-tests bus-bandwidth factors, the correctness checks (each shown to fail on a wrong
result), the patterns against an emulated collective, and a small 2-rank Gloo run."""
import json

import pytest
import torch

from converge.bench.collectives import (
    CollectivesConfig, algorithm_bandwidth, allgather_busbw, allgather_input, allreduce_busbw, allreduce_input,
    broadcast_busbw, broadcast_input, bus_bandwidth, check_allgather, check_allreduce, check_broadcast,
    check_reduce_scatter, element_count, message_sizes, parse_bytes, reduce_scatter_busbw, reduce_scatter_input,
    run_collectives_benchmark, write_results,
)


def test_bus_bandwidth_factors_against_hand_computed_values():
    algbw = algorithm_bandwidth(10 * 10**9, 1.0)  # 10 GB in 1 s
    assert algbw == 1e10
    # nccl-tests doc/PERFORMANCE.md: allreduce 2(n-1)/n, allgather and reduce_scatter (n-1)/n, broadcast 1
    assert allreduce_busbw(algbw, 4) == pytest.approx(1.5e10)  # 10 x 2 x 3 / 4
    assert allreduce_busbw(algbw, 2) == pytest.approx(1.0e10)  # 10 x 2 x 1 / 2
    assert allreduce_busbw(algbw, 8) == pytest.approx(1.75e10)  # 10 x 2 x 7 / 8
    assert allgather_busbw(algbw, 4) == pytest.approx(7.5e9)  # 10 x 3 / 4
    assert reduce_scatter_busbw(algbw, 8) == pytest.approx(8.75e9)  # 10 x 7 / 8
    assert broadcast_busbw(algbw, 8) == algbw
    assert allreduce_busbw(algbw, 1) == 0 and allgather_busbw(algbw, 1) == 0
    assert bus_bandwidth("allreduce", algbw, 4) == allreduce_busbw(algbw, 4)


def emulate(op: str, world: int, count: int) -> list[torch.Tensor]:
    """What each rank should hold after ``op`` on the benchmark's patterns, computed without torch.distributed."""
    if op == "allreduce":
        total = sum(allreduce_input(r, count) for r in range(world))
        return [total.clone() for _ in range(world)]
    if op == "allgather":
        gathered = torch.cat([allgather_input(r, count // world) for r in range(world)])
        return [gathered.clone() for _ in range(world)]
    if op == "reduce_scatter":
        total = sum(reduce_scatter_input(r, world, count // world) for r in range(world))
        return list(total.chunk(world))
    return [broadcast_input(0, count) for _ in range(world)]


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_patterns_pass_their_checks_when_the_collective_is_right(world):
    count = element_count("allgather", 96, world)
    for result in emulate("allreduce", world, 24):
        assert check_allreduce(result, world)
    for result in emulate("allgather", world, count):
        assert check_allgather(result, world)
    for rank, result in enumerate(emulate("reduce_scatter", world, count)):
        assert check_reduce_scatter(result, world, rank)
    for result in emulate("broadcast", world, 24):
        assert check_broadcast(result)


def test_checks_catch_wrong_results():
    world = 4
    good = emulate("allreduce", world, 16)[0]
    wrong = good.clone()
    wrong[7] += 1  # one element off
    assert check_allreduce(good, world) and not check_allreduce(wrong, world)
    assert not check_allreduce(allreduce_input(2, 16), world)  # a no-op allreduce
    assert not check_allreduce(good, world + 1)
    gathered = emulate("allgather", world, 16)[0]
    swapped = torch.cat([gathered[4:8], gathered[:4], gathered[8:]])  # ranks 0 and 1 in the wrong order
    assert check_allgather(gathered, world) and not check_allgather(swapped, world)
    chunks = emulate("reduce_scatter", world, 16)
    assert check_reduce_scatter(chunks[2], world, 2) and not check_reduce_scatter(chunks[1], world, 2)
    assert not check_reduce_scatter(torch.full((4,), float("nan")), world, 0)
    assert check_broadcast(broadcast_input(0, 8)) and not check_broadcast(broadcast_input(3, 8))  # not received


def test_sizes_and_counts():
    assert message_sizes(8, 64) == (8, 16, 32, 64)
    assert message_sizes(8, 2**30, 4)[-1] == 2**29
    assert element_count("allreduce", 8, 3) == 2  # 8 B of float32
    assert element_count("allgather", 8, 3) == 3  # at least one element per rank
    assert element_count("reduce_scatter", 1024, 3) == 255  # 256 floats rounded down to a multiple of 3
    assert parse_bytes("8") == 8 and parse_bytes("64K") == 65536 and parse_bytes("256M") == 2**28
    assert parse_bytes("1G") == 2**30 and parse_bytes("1GiB") == 2**30
    with pytest.raises(ValueError, match="give a size like 8, 64K, 256M or 1G"):
        parse_bytes("lots")


def test_config_errors_say_how_to_fix_them():
    with pytest.raises(ValueError, match="choose from allreduce, allgather, reduce_scatter, broadcast"):
        CollectivesConfig(ops=("alltoall",))
    with pytest.raises(ValueError, match="NCCL moves GPU memory"):
        CollectivesConfig(backend="nccl")
    with pytest.raises(ValueError, match="factor >= 2"):
        CollectivesConfig(factor=1)
    assert CollectivesConfig().sizes[-1] == 256 * 2**20 and CollectivesConfig(device="cuda").sizes[-1] == 2**30


def test_two_gloo_ranks_measure_and_pass_every_check(tmp_path):
    cfg = CollectivesConfig.quick()
    r = run_collectives_benchmark(cfg)
    assert r["backend"] == "gloo" and r["world"] == 2 and r["launcher"] == "torch.multiprocessing.spawn"
    assert len(r["rows"]) == len(cfg.ops) * len(cfg.sizes)
    for row in r["rows"]:
        assert row["correct"] and row["wrong_ranks"] == 0
        assert row["seconds"] > 0 and row["repeats"] >= 1 and row["algbw_GBps"] > 0
        assert row["algbw_GBps"] == pytest.approx(row["bytes"] / row["seconds"] / 1e9)
        assert row["busbw_GBps"] == pytest.approx(bus_bandwidth(row["op"], row["algbw_GBps"], 2))
    assert r["all_correct"] and set(r["summary"]) == set(cfg.ops)
    json_path, png_path = write_results(r, tmp_path)
    assert json.loads(json_path.read_text())["all_correct"] is True
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
