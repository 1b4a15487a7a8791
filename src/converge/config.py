"""Configuration: TOML files into frozen dataclasses, unknown keys refused.

A config file has one table per stage, e.g.::

    [app]          # the app's physics settings (its ``config_cls``)
    sample_rate = 2048
    [simulate]
    samples = 2000
    [train]
    epochs = 8

Each command reads the tables it needs; command-line flags and ``--set
section.key=value`` override the file. Every problem raises :class:`ConfigError`
naming the key and how to fix it.
"""
from __future__ import annotations

import dataclasses
import json
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Mapping, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value or key is wrong; the message names it and the fix."""


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], key)
    if origin is tuple:
        if isinstance(value, str):  # from --set section.key=a,b,c
            value = [part.strip() for part in value.split(",") if part.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        item = args[0] if args else Any
        return tuple(_coerce(v, item, key) for v in value)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    return value


def from_dict(cls: type[T], data: Mapping[str, Any], section: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; unknown keys and bad types raise."""
    prefix = f"{section}." if section else ""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown key {prefix}{unknown[0]}; valid keys in [{section or cls.__name__}] are: "
            + ", ".join(sorted(fields))
        )
    kwargs = {name: _coerce(value, hints[name], prefix + name) for name, value in data.items()}
    return cls(**kwargs)  # __post_init__ raises ConfigError naming section.key


def read_toml(path: str | Path | None) -> dict[str, Any]:
    """The tables of a TOML config file (empty for ``None``), with clear errors."""
    if path is None:
        return {}
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file {path} is not valid TOML: {err}") from None


def parse_positive_ints(text: str, example: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> (1, 2, 4), or a ValueError that shows ``example`` as the fix."""
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"{text!r}: give comma-separated whole numbers, e.g. {example}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{text!r}: give one or more numbers >= 1, e.g. {example}")
    return values


def parse_positive_floats(text: str, example: str) -> tuple[float, ...]:
    """``"150,300"`` -> (150.0, 300.0), or a ValueError that shows ``example`` as the fix."""
    try:
        values = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"{text!r}: give comma-separated numbers, e.g. {example}") from None
    if not values or not min(values) > 0:
        raise ValueError(f"{text!r}: give one or more numbers > 0, e.g. {example}")
    return values


def parse_overrides(items: list[str] | None) -> dict[str, dict[str, Any]]:
    """``["train.lr=1e-3", ...]`` -> ``{"train": {"lr": "1e-3"}}`` (coerced later)."""
    out: dict[str, dict[str, Any]] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not name:
            raise ConfigError(f"--set {item!r}: write it as section.key=value, e.g. train.lr=0.001")
        out.setdefault(section, {})[name] = value.strip()
    return out


def load_section(
    cls: type[T],
    tables: Mapping[str, Any],
    section: str,
    overrides: Mapping[str, Any] | None = None,
) -> T:
    """Dataclass for ``[section]`` of ``tables``, with ``overrides`` (None values skipped)."""
    data = dict(tables.get(section, {}))
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return from_dict(cls, data, section)


def check_sections(tables: Mapping[str, Any], allowed: set[str]) -> None:
    """Refuse tables that no stage reads (a typo such as ``[trian]``)."""
    for name in tables:
        if name not in allowed:
            raise ConfigError(f"unknown section [{name}]; valid sections are: " + ", ".join(sorted(allowed)))


def to_dict(obj: Any) -> Any:
    """A dataclass (or nest of them) as plain JSON-ready data."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return obj


def dump_json(obj: Any) -> str:
    """Deterministic JSON text of a config (sorted keys), for hashing and saving."""
    return json.dumps(to_dict(obj), sort_keys=True, indent=2)
