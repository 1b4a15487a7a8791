"""The darcy example app (examples/darcy, package converge_darcy): physics, operator, contract, error paths.

The end-to-end run through the command line is in test_darcy_end_to_end.py.
"""
from dataclasses import replace

import numpy as np
import pytest
import torch

pytest.importorskip("converge_darcy", reason="the darcy example is not installed: pip install -e examples/darcy")

import scipy.sparse as sp  # noqa: E402

from converge.config import ConfigError, from_dict  # noqa: E402
from converge.simulate.sample import check_arrays  # noqa: E402
from converge.data.store import schema_to_json  # noqa: E402
from converge_darcy import DarcyApp, DarcyConfig, DarcyEvalConfig, DarcyLearnConfig  # noqa: E402
from converge_darcy.app import relative_spread  # noqa: E402
from converge_darcy.learning import block_average  # noqa: E402
from converge_darcy.model import FNO2d, relative_l2  # noqa: E402
from converge_darcy.permeability import (gaussian_random_field, grf_sqrt_eigenvalues,  # noqa: E402
                                         sample_permeability)
from converge_darcy.predict import read_fields  # noqa: E402
from converge_darcy.report import darcy_tables  # noqa: E402
from converge_darcy.solver import (assemble_darcy, face_permeability, interior_rhs, solve_amg, solve_darcy,  # noqa: E402
                                   solve_direct)

TINY = DarcyConfig.tiny()


def field(n=32, seed=3):
    return sample_permeability(n, 2.0, 3.0, 12.0, 3.0, seed)


# -- the solver ---------------------------------------------------------------------------------
def manufactured_error(n: int, k_value: float, mean: str) -> float:
    """Max nodal error for u = sin(pi x) sin(pi y), constant k, f = 2 pi^2 k sin(pi x) sin(pi y)."""
    x = np.linspace(0.0, 1.0, n)
    exact = np.outer(np.sin(np.pi * x), np.sin(np.pi * x))
    u = solve_darcy(np.full((n, n), k_value), 2 * np.pi**2 * k_value * exact, mean=mean)
    return float(np.abs(u - exact).max())


@pytest.mark.parametrize("mean", ["harmonic", "arithmetic"])
def test_manufactured_solution_converges_at_second_order(mean):
    errors = [manufactured_error(n, 3.0, mean) for n in (17, 33, 65)]  # h = 1/16, 1/32, 1/64
    orders = np.log2(np.array(errors[:-1]) / np.array(errors[1:]))
    assert np.all((orders > 1.95) & (orders < 2.05)), orders
    assert errors[-1] < 3e-4


def test_direct_and_both_amg_solvers_agree_to_1e_8():
    k = field(64)
    a, b = assemble_darcy(k), interior_rhs(1.0, 64)
    direct = solve_direct(a, b)
    for method in ("ruge_stuben", "smoothed_aggregation"):
        amg = solve_amg(a, b, method, tol=1e-12)
        assert np.linalg.norm(amg - direct) / np.linalg.norm(direct) < 1e-8
    np.testing.assert_allclose(a @ direct, b, rtol=1e-10)


def test_matrix_is_symmetric_positive_definite():
    a = assemble_darcy(field(16))
    assert isinstance(a, sp.csr_matrix) and a.shape == (14 * 14, 14 * 14)
    assert abs(a - a.T).max() == 0
    assert np.linalg.eigvalsh(a.toarray()).min() > 0
    assert a.nnz == 5 * 14 * 14 - 4 * 14  # five points, less the boundary neighbours


def test_pressure_is_zero_on_the_boundary_and_positive_inside():
    u = solve_darcy(field(32), 1.0)
    assert np.all(u[0] == 0) and np.all(u[-1] == 0) and np.all(u[:, 0] == 0) and np.all(u[:, -1] == 0)
    assert np.all(u[1:-1, 1:-1] > 0)  # discrete maximum principle for f > 0 (A is an M-matrix)


def test_pressure_scales_inversely_with_k_and_linearly_with_f_and_transposes_with_k():
    k = field(24)
    u = solve_darcy(k, 1.0)
    np.testing.assert_allclose(solve_darcy(4.0 * k, 1.0), u / 4.0, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(solve_darcy(k, 2.5), 2.5 * u, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(solve_darcy(k.T.copy(), 1.0), u.T, rtol=1e-10, atol=1e-15)  # x <-> y symmetry


def test_face_means_known_values_and_their_order():
    assert face_permeability(np.array(3.0), np.array(12.0)) == pytest.approx(4.8)  # 2 * 36 / 15
    assert face_permeability(np.array(3.0), np.array(12.0), "arithmetic") == pytest.approx(7.5)
    assert face_permeability(np.array(5.0), np.array(5.0)) == face_permeability(np.array(5.0), np.array(5.0),
                                                                               "arithmetic")
    harmonic, arithmetic = (solve_darcy(field(32), 1.0, mean=m) for m in ("harmonic", "arithmetic"))
    assert harmonic.sum() > arithmetic.sum()  # less flux across phase boundaries: higher pressure
    with pytest.raises(ValueError, match="choose harmonic or arithmetic"):
        face_permeability(np.array(1.0), np.array(2.0), "geometric")


def test_solver_refuses_bad_permeability_and_forcing():
    with pytest.raises(ValueError, match="square n x n field"):
        assemble_darcy(np.ones((4, 5)))
    with pytest.raises(ValueError, match="finite and > 0"):
        assemble_darcy(np.zeros((5, 5)))
    with pytest.raises(ValueError, match="number or an 5 x 5 node field"):
        interior_rhs(np.ones((4, 4)), 5)
    with pytest.raises(ValueError, match="choose direct or amg"):
        solve_darcy(np.ones((5, 5)), solver="cholmod")


# -- the permeability prior ------------------------------------------------------------------------
def test_thresholded_field_is_two_phase_seeded_and_about_half_high():
    a, b = field(32, seed=1), field(32, seed=1)
    assert np.array_equal(a, b) and not np.array_equal(a, field(32, seed=2))
    assert set(np.unique(a)) <= {3.0, 12.0}
    share = np.mean([(field(32, seed=s) == 12.0).mean() for s in range(40)])
    assert 0.4 < share < 0.6  # a zero-mean field is >= 0 about half the time


def test_random_field_has_zero_mean_and_the_covariance_spectrum():
    coef = grf_sqrt_eigenvalues(8, 2.0, 3.0)
    assert coef[0, 0] == 0
    assert coef[1, 0] == pytest.approx(3.0 * (np.pi**2 + 9.0) ** -1.0)  # tau^(a-1) (pi^2 + tau^2)^(-a/2), a = 2
    g = gaussian_random_field(32, 2.0, 3.0, np.random.default_rng(0))
    assert abs(g.mean()) < 1e-12 and g.std() > 0  # the constant mode is dropped


# -- the operator ---------------------------------------------------------------------------------
def test_fno_runs_at_any_resolution_and_keeps_the_boundary_at_zero():
    torch.manual_seed(0)
    model = FNO2d(width=8, modes=4, layers=2, padding=4)
    for n in (16, 24, 33):
        k = torch.from_numpy(field(n)).float()[None].repeat(3, 1, 1)  # (3, n, n)
        u = model(k)
        assert u.shape == (3, n, n) and u.dtype == torch.float32
        assert torch.all(u[:, 0] == 0) and torch.all(u[:, :, -1] == 0)


def test_fno_normalisation_travels_in_the_state_dict():
    k, u = torch.from_numpy(field(16)).float()[None], torch.rand(1, 16, 16)
    model = FNO2d(width=8, modes=4, layers=2, padding=4)
    model.set_normalisation(k, u)
    assert float(model.k_mean) == pytest.approx(float(k.mean())) and float(model.u_scale) > 0
    copy = FNO2d(width=8, modes=4, layers=2, padding=4)
    copy.load_state_dict(model.state_dict())
    with torch.inference_mode():
        assert torch.equal(copy(k), model(k))


def test_relative_l2_known_values_and_it_sees_a_wrong_answer():
    x = torch.rand(4, 8, 8) + 0.1
    assert torch.all(relative_l2(x, x) == 0)
    torch.testing.assert_close(relative_l2(2 * x, x), torch.ones(4))
    wrong = x.clone()
    wrong[0, 3, 3] += 1.0
    assert relative_l2(wrong, x)[0] > 0.01 and torch.all(relative_l2(wrong, x)[1:] == 0)


def test_training_steps_without_a_checkpoint_lower_the_loss():
    app = DarcyApp()
    arrays = {k: np.stack([app.simulate(TINY, {"permeability_seed": float(s)})[k] for s in range(24)])
              for k in ("permeability", "pressure")}
    torch.manual_seed(0)
    model = app.make_model(TINY)
    train_src, val_src = app.make_datasets(TINY, arrays, seed=0, val_fraction=0.25)
    assert (len(train_src), len(val_src)) == (18, 6)
    app.fit_to_data(model, train_src)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    batch = next(iter(train_src.batches(0, 18)))
    losses = []
    for _ in range(30):
        loss = app.loss(TINY, app.forward(model, batch), batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0]
    metrics = app.metrics(app.forward(model, batch).detach(), batch)
    assert set(metrics) == {"relative_l2", "relative_l2_median", "relative_l2_p90"}


# -- the contract ------------------------------------------------------------------------------------
def test_simulate_matches_the_schema_and_the_served_input_reproduces_it():
    app = DarcyApp()
    params = app.sample_parameters(TINY, np.random.default_rng(0))
    assert set(params) == {"permeability_seed"} and 0 <= params["permeability_seed"] < 2**53
    arrays = check_arrays(app.simulate(TINY, params), schema_to_json(app.schema(TINY)))
    again = app.simulate_inputs(TINY, {"permeability": arrays["permeability"][None]})
    np.testing.assert_array_equal(again["pressure"][0], arrays["pressure"])
    with pytest.raises(ValueError, match=r"takes \(B, 16, 16\)"):
        app.simulate_inputs(TINY, {"permeability": arrays["permeability"]})


def test_serving_signature_example_and_predict_agree():
    app = DarcyApp()
    inputs, outputs = app.serving_signature(TINY)
    assert inputs[0].shape == (-1, 16, 16) and outputs[0].name == "pressure"
    example = app.serving_example(TINY, 3, seed=5)
    assert example["permeability"].shape == (3, 16, 16) and example["permeability"].dtype == np.float32
    with torch.inference_mode():
        out = app.serve_predict(app.make_model(TINY), {"permeability": torch.from_numpy(example["permeability"])})
    assert out["pressure"].shape == (3, 16, 16)


def test_uncertainty_is_the_relative_spread():
    mean = np.ones((2, 4, 4))
    std = np.stack([np.zeros((4, 4)), np.full((4, 4), 0.1)])
    np.testing.assert_allclose(relative_spread(mean, std), [0.0, 0.1])
    np.testing.assert_allclose(DarcyApp().uncertainty(TINY, {}, {"pressure": mean}, {"pressure": std}), [0.0, 0.1])


def test_classical_baseline_answers_as_the_simulator():
    app = DarcyApp()
    example = app.serving_example(TINY, 2)
    for quick in (True, False):
        baseline = app.classical_baseline(TINY, torch.device("cpu"), quick=quick)
        assert baseline.batch == 1 and baseline.details["solver"] in ("direct", "amg_ruge_stuben",
                                                                       "amg_smoothed_aggregation")
        np.testing.assert_allclose(baseline.run(example), app.simulate_inputs(TINY, example)["pressure"],
                                   rtol=1e-6, atol=1e-9)


def test_learning_problem_inputs_are_the_simulators_fields():
    app = DarcyApp()
    problem = app.learning_problem(TINY, DarcyLearnConfig(target_error=0.05))
    assert problem.target_error == 0.05 and problem.curve_metrics == ("relative_l2",)
    params = problem.draw(seed=4, n=3)
    assert problem.draw(seed=4, n=3) == params and problem.draw_test(seed=5, n=3) != params
    inputs = problem.inputs(params)
    np.testing.assert_array_equal(inputs["permeability"][1], problem.label(params[1])["permeability"])
    assert problem.descriptors(inputs).shape == (3, 64)


def test_block_average_known_value():
    fields = np.arange(16.0).reshape(1, 4, 4)
    np.testing.assert_allclose(block_average(fields, 2), [[2.5, 4.5, 10.5, 12.5]])


def test_synthetic_batch_gives_a_finite_loss():
    app = DarcyApp()
    batch = app.synthetic_batch(TINY, 4, torch.Generator().manual_seed(0))
    assert batch["input"].shape == (4, 16, 16)
    assert torch.isfinite(app.loss(TINY, app.forward(app.make_model(TINY), batch), batch))


def test_report_tables_render_a_result():
    result = {"relative_l2": 0.015, "n_train_solves": 2000, "n_test": 200, "resolution": 64, "threads": 1,
              "fno_batch": 64, "speed_table": {"64": {
                  "seconds_per_field": {"direct": 4e-3, "amg_ruge_stuben": 7e-3, "amg_smoothed_aggregation": 9e-3,
                                        "fno_single": 8e-3, "fno_batched": 5e-3},
                  "fastest_classical": "direct", "speedup": {"single": 0.5, "batched": 0.8}}},
              "wall_seconds": {"train": 100.0}}
    tables = darcy_tables(result)
    assert [t.caption.split()[0] for t in tables] == ["FNO", "Seconds", "Wall"]
    assert tables[1].rows[0][:2] == ["64", "4"] and tables[1].rows[0][-3:] == ["direct", "0.5", "0.8"]
    assert DarcyApp().report_sections()[0].stems == ("darcy",)


# -- error paths ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("changes, message", [
    ({"resolution": 2}, "app.resolution=2: give the nodes per side as an integer >= 4"),
    ({"alpha": 1.0}, "needs alpha > 1"),
    ({"tau": 0.0}, "app.tau=0.0: must be > 0"),
    ({"k_low": 12.0, "k_high": 3.0}, "need 0 < k_low <= k_high"),
    ({"forcing": -1.0}, "give a positive source"),
    ({"solver": "cholmod"}, "app.solver='cholmod': choose one of direct, amg"),
    ({"face_mean": "geometric"}, "choose one of harmonic, arithmetic"),
    ({"amg_method": "gmg"}, "choose one of smoothed_aggregation, ruge_stuben"),
    ({"amg_tol": 0.5}, "relative residual in"),
    ({"width": 0}, "app.width=0: must be an integer >= 1"),
    ({"modes": 40}, "use at most 36"),
])
def test_config_errors_say_how_to_fix_the_value(changes, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        replace(DarcyConfig(), **changes)


def test_config_files_refuse_unknown_keys_and_other_tables_validate():
    with pytest.raises(ConfigError, match="unknown key app.resolutoin"):
        from_dict(DarcyConfig, {"resolutoin": 32}, "app")
    with pytest.raises(ConfigError, match="evaluate.timing_fields=0"):
        DarcyEvalConfig(timing_fields=0)
    with pytest.raises(ConfigError, match="learn.target_error=2"):
        DarcyLearnConfig(target_error=2)


def test_predict_file_reader_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_fields(tmp_path / "none.npy")
    (tmp_path / "k.txt").write_text("1")
    with pytest.raises(ValueError, match="give a .npy or .npz"):
        read_fields(tmp_path / "k.txt")
    np.savez(tmp_path / "k.npz", k=np.ones((2, 4, 4)))
    with pytest.raises(ValueError, match="save the fields under 'permeability'"):
        read_fields(tmp_path / "k.npz")
    np.save(tmp_path / "neg.npy", -np.ones((4, 4)))
    with pytest.raises(ValueError, match="finite and > 0"):
        read_fields(tmp_path / "neg.npy")
    np.save(tmp_path / "one.npy", np.ones((4, 4)))
    assert read_fields(tmp_path / "one.npy").shape == (1, 4, 4)
