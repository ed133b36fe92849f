"""Config dataclass fields that describe their own flag: one default, one help text, one env name.

A field made with `setting(...)` carries its help text, its flag name (if not `--field-name`),
its choices and its environment name (if not `CROWDCHAT_<FLAG>`) in its metadata; `add_arguments`
turns every such field into an argparse flag whose default is the dataclass default, overridden
by the environment, and `from_namespace` builds the dataclass back from the parsed flags.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from dataclasses import MISSING, Field, field, fields
from pathlib import Path
from typing import Any, ClassVar, Self

SCALARS = (str, int, float, Path)


def setting(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    env: str | None = None,
    choices: tuple[str, ...] | None = None,
    cli: bool = True,
) -> Any:
    """A config field with its default and how operators set it (`cli=False`: no flag)."""
    meta = {"help": help, "flag": flag, "env": env, "choices": choices, "cli": cli}
    return field(default=default, metadata=meta)


def flag_name(f: Field) -> str:
    """`--field-name` unless the field names another flag."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def env_name(f: Field) -> str:
    """CROWDCHAT_<FLAG> (README's rule) unless the field names another variable."""
    return f.metadata.get("env") or "CROWDCHAT_" + flag_name(f)[2:].upper().replace("-", "_")


def scalar_type(annotation: Any) -> type:
    """The one scalar type of `int`, `float | None`, `Path | None`, ... (what argparse converts)."""
    if isinstance(annotation, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        assert len(args) == 1, f"a setting is one scalar or None, not {annotation}"
        annotation = args[0]
    assert annotation in SCALARS, f"unsupported setting type {annotation}"
    return annotation


def add_arguments(cls: type, parser: argparse.ArgumentParser, title: str) -> None:
    """One flag per `setting` field of dataclass `cls`, in an argument group called `title`.

    An environment variable that is set and not empty replaces the dataclass default; a value
    that does not convert stops the parser with the variable's name (like a bad flag would).
    """
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if not f.metadata.get("cli", False):
            continue
        assert f.default is not MISSING, f"setting {f.name} needs a default"
        kind, flag, env = scalar_type(hints[f.name]), flag_name(f), env_name(f)
        default = f.default
        raw = os.environ.get(env, "")
        if raw:
            try:
                default = kind(raw)
            except ValueError:
                parser.error(
                    f"environment {env}={raw!r} is not a valid {kind.__name__} (it sets {flag})"
                )
        shown = "off" if f.default is None else f.default
        group.add_argument(
            flag,
            dest=f.name,
            type=kind,
            default=default,
            choices=f.metadata.get("choices"),
            help=f"{f.metadata['help']} (default: {shown}; env {env})".replace("%", "%%"),
        )


def from_namespace(cls: type, ns: argparse.Namespace) -> Any:
    """Build dataclass `cls` from parsed flags: its fields that `ns` has, defaults for the rest."""
    return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})


class Settings:
    """Mixin for a frozen config dataclass made of `setting` fields: its flags and back."""

    section: ClassVar[str] = "settings"

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add this config's flags (each overridable by its CROWDCHAT_* variable) to `parser`."""
        add_arguments(cls, parser, cls.section)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> Self:
        """Build the config from parsed flags (attributes it does not have are ignored)."""
        return from_namespace(cls, ns)
