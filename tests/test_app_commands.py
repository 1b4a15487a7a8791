"""Apps add their own subcommands through the contract (``App.commands``): ``converge VERB APP ...``."""
from __future__ import annotations

from types import SimpleNamespace

import typer
from typer.testing import CliRunner

from converge import cli as cli_module
from converge.contract import App, CommandError, Monitor


def greet(name: str = typer.Argument(..., help="Whom to greet."), loud: bool = typer.Option(False)) -> None:
    """Say hello (a toy app command)."""
    if name == "nobody":
        raise CommandError("nobody to greet: give a name")
    print(("HELLO " if loud else "hello ") + name)


class GreetingApp(App):
    """An app that only adds a command: its stages are never called here."""

    name, config_cls, monitor = "greeter", dict, Monitor("loss", "min")
    schema = sample_parameters = simulate = make_model = make_datasets = loss = metrics = evaluate = None

    def commands(self):
        return {"greet": greet, "train": greet}  # train: a verb converge has; refused


def broken_load():
    raise ImportError("No module named 'missing_dependency'")


def fake_apps():
    return {"greeter": SimpleNamespace(load=lambda: GreetingApp), "broken": SimpleNamespace(load=broken_load)}


def root_cli() -> typer.Typer:
    root = typer.Typer(rich_markup_mode=None)
    root.command("train")(lambda: None)
    root.command("apps")(lambda: None)
    return root


def test_an_app_command_runs_as_verb_then_app(monkeypatch):
    monkeypatch.setattr("converge.contract.available_apps", fake_apps)
    root = root_cli()
    added = cli_module.add_app_commands(root)
    assert added == {"greet": ["greeter"]}
    runner = CliRunner()
    result = runner.invoke(root, ["greet", "greeter", "world", "--loud"])
    assert result.exit_code == 0, result.output
    assert "HELLO world" in result.output
    assert "Whom to greet" in runner.invoke(root, ["greet", "greeter", "--help"]).output


def test_an_app_command_fails_clearly(monkeypatch):
    monkeypatch.setattr("converge.contract.available_apps", fake_apps)
    root = root_cli()
    cli_module.add_app_commands(root)
    result = CliRunner().invoke(root, ["greet", "greeter", "nobody"])
    assert result.exit_code == 2
    assert "nobody to greet: give a name" in result.output


def test_a_broken_app_and_a_taken_verb_are_left_out_with_a_warning(monkeypatch, capsys):
    monkeypatch.setattr("converge.contract.available_apps", fake_apps)
    root = root_cli()
    cli_module.add_app_commands(root)
    err = capsys.readouterr().err
    assert "app 'broken' did not load (ImportError" in " ".join(err.split())
    assert "offers the command 'train', which converge already has" in " ".join(err.split())
    assert sum(c.name == "train" for c in root.registered_commands) == 1


def test_gw_supplies_detect():
    result = CliRunner().invoke(cli_module.cli, ["detect", "gw", "--help"])
    assert result.exit_code == 0 and "GWOSC" in result.output
    result = CliRunner().invoke(cli_module.cli, ["detect", "gw", "/nonexistent.hdf5", "--run", "/nonexistent"])
    assert result.exit_code == 2 and "error" in result.output
