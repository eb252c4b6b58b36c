"""Where `shardlm serve` settings come from: flags, a TOML/JSON file, the environment.

    defaults  <-  SHARDLM_<NAME> environment variables  <-  the --config file  <-  flags

(each source overrides the ones to its left). `add_serve_arguments` builds the flags from the
ServeConfig table, with each flag's default and environment variable in its help; `resolve`
merges the sources and validates the result once (gateway.config.check).
"""

from __future__ import annotations

import argparse
import json
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardlm_server.gateway.config import (
    GROUPS,
    SETTINGS,
    ConfigError,
    ServeConfig,
    check,
    default,
    env_var,
    flag,
    spec_of,
)

CONFIG_ENV = "SHARDLM_CONFIG"
# A flag's value in --help when its setting names none: every float setting is in seconds.
METAVARS = {int: "N", float: "SECONDS", str: "PATH"}
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
_HINTS = typing.get_type_hints(ServeConfig)


def value_type(name: str) -> tuple[type, bool]:
    """The setting's base type (bool, int, float or str) and whether it may be unset (None)."""
    hint = _HINTS[name]
    if isinstance(hint, types.UnionType):
        (base,) = (a for a in typing.get_args(hint) if a is not type(None))
        return base, True
    return hint, False


def _shown(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per setting (all defaulting to None, so only given flags override), grouped as
    in ServeConfig. Values stay text here and are parsed like environment values."""
    parser.add_argument("--config", metavar="FILE",
                        help=f"TOML or JSON file of settings (keys: the flag names with "
                        f"underscores) [env: {CONFIG_ENV}]")
    groups = {g: parser.add_argument_group(g) for g in GROUPS}
    for name in SETTINGS:
        spec, (kind, _optional) = spec_of(name), value_type(name)
        text = f"{spec.help} [default: {_shown(default(name))}; env: {env_var(name)}]"
        text = text.replace("%", "%%")
        group = groups[spec.group]
        if kind is bool and name.startswith("no_"):
            group.add_argument(flag(name), dest=name, action="store_const", const="1",
                               default=None, help=text)
        elif kind is bool:
            group.add_argument(flag(name), dest=name, action=argparse.BooleanOptionalAction,
                               default=None, help=text)
        else:
            metavar = ("{" + ",".join(spec.choices) + "}" if spec.choices
                       else spec.metavar or METAVARS[kind])
            group.add_argument(flag(name), dest=name, default=None, metavar=metavar, help=text)


def parse_text(name: str, text: str, source: str) -> Any:
    """A setting's value from a flag or environment string."""
    kind, _optional = value_type(name)
    raw = text.strip()
    if kind is bool:
        if raw.lower() in TRUE_WORDS:
            return True
        if raw.lower() in FALSE_WORDS:
            return False
        raise ConfigError(f"{source}: expected on/off (1/0, true/false), not {text!r}")
    if kind is int:
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"{source}: expected an integer, not {text!r}") from None
    if kind is float:
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"{source}: expected a number, not {text!r}") from None
    return text


def check_file_value(name: str, value: Any, source: str) -> Any:
    """A setting's value from a parsed TOML/JSON file, whose values carry their own types."""
    kind, optional = value_type(name)
    if value is None and optional:
        return None
    ok = {bool: isinstance(value, bool),
          int: isinstance(value, int) and not isinstance(value, bool),
          float: isinstance(value, int | float) and not isinstance(value, bool),
          str: isinstance(value, str)}[kind]
    if not ok:
        wanted = {bool: "true or false", int: "an integer", float: "a number",
                  str: "a string"}[kind]
        raise ConfigError(f"{source}: {name} must be {wanted}, not {value!r}")
    return float(value) if kind is float else value


def read_file(path: str) -> dict[str, Any]:
    """The settings of a TOML file (JSON when the name ends in .json)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    try:
        raw = json.loads(text) if path.endswith(".json") else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid "
                          f"{'JSON' if path.endswith('.json') else 'TOML'}: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a table of settings")
    unknown = sorted(set(raw) - set(SETTINGS))
    if unknown:
        raise ConfigError(f"unknown keys in {path}: {', '.join(unknown)}")
    return {k: check_file_value(k, v, path) for k, v in raw.items()}


def resolve(flags: Mapping[str, Any], config_file: str | None = None,
            environ: Mapping[str, str] | None = None) -> ServeConfig:
    """Merge defaults <- environment <- file <- flags (flag values as argparse left them: text,
    or None when not given) and validate. Raises ConfigError."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name in SETTINGS:
        text = environ.get(env_var(name), "")
        if text.strip():
            values[name] = parse_text(name, text, env_var(name))
            sources[name] = env_var(name)
    config_file = config_file or environ.get(CONFIG_ENV) or None
    if config_file:
        for name, value in read_file(config_file).items():
            values[name], sources[name] = value, config_file
    for name in SETTINGS:
        text = flags.get(name)
        if text is not None:
            values[name] = parse_text(name, str(text), flag(name))
            sources[name] = flag(name)
    return check(ServeConfig(**values), sources)


def from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> ServeConfig:
    return resolve(vars(args), getattr(args, "config", None), environ)
