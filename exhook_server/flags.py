"""Command-line flags generated from the settings table, so every setting has one.

Each `Config` field becomes `--<name-with-dashes>`, its help taken from the comment above the
field. A flag's text goes through the same conversion as its `SDV_FANOUT_<NAME>` variable
(`config.load`'s overrides), so the two can never disagree; a flag not given is None and
leaves the lower sources (environment, file, defaults) in force.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import re
import typing
from collections.abc import Iterable
from typing import Any

from exhook_server.config import CHOICES, Config

_NAMES = tuple(f.name for f in dataclasses.fields(Config))
_HINTS = typing.get_type_hints(Config)
_FIELD_LINE = re.compile(r"(\w+)\s*:")


def flag(name: str) -> str:
    """The flag of a setting: `max_ids_per_batch` → `--max-ids-per-batch`."""
    return "--" + name.replace("_", "-")


@functools.cache
def setting_help() -> dict[str, str]:
    """The comment right above each field of `Config`: the table documents itself once.

    Fields that share the comment of the field before them get none (their flag shows the
    default only). Empty when the source is not installed (a zipped build).
    """
    try:
        source = inspect.getsource(Config)
    except (OSError, TypeError):
        return {}
    out: dict[str, str] = {}
    block: list[str] = []
    for line in source.splitlines():
        text = line.strip()
        if text.startswith("#"):
            body = text.lstrip("#").strip()
            block = [] if body.startswith("--") else [*block, body]  # `# -- storage ---` is a rule
            continue
        match = _FIELD_LINE.match(text)
        if match and match.group(1) in _NAMES and block:
            out[match.group(1)] = " ".join(block)
        block = []
    return out


def _metavar(name: str, kind: Any) -> str:
    if kind == tuple[str, ...]:
        return "A,B"
    for suffix, metavar in (("_s", "SECONDS"), ("_ms", "MS"), ("_bytes", "BYTES"), ("_file", "FILE")):
        if name.endswith(suffix):
            return metavar
    if name.endswith("listen"):
        return "HOST:PORT"
    if name.endswith("_dir"):
        return "DIR"
    return {int: "N", float: "NUMBER"}.get(kind, "TEXT")


def _shown(default: Any) -> str:
    if isinstance(default, tuple):
        return ",".join(default) or '""'
    if isinstance(default, bool):
        return "on" if default else "off"
    return repr(default) if default == "" else str(default)


def add_setting_flags(parser: argparse.ArgumentParser, names: Iterable[str] | None = None) -> None:
    """One flag per setting in `names` (all of them by default), in the table's order."""
    defaults = Config()
    helps = setting_help()
    group = parser.add_argument_group("settings (flags beat SDV_FANOUT_* variables, which beat the --config file)")
    for name in _NAMES if names is None else names:
        kind = _HINTS[name]
        text = helps.get(name, "")
        text = f"{text} (default: {_shown(getattr(defaults, name))})".strip().replace("%", "%%")
        if kind is bool:
            group.add_argument(flag(name), dest=name, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            choices = CHOICES.get(name)
            group.add_argument(
                flag(name),
                dest=name,
                default=None,
                choices=choices,
                metavar=None if choices else _metavar(name, kind),
                help=text,
            )


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given as flags, raw, for `config.load(overrides=...)` (None = not given)."""
    return {name: getattr(args, name) for name in _NAMES if getattr(args, name, None) is not None}
