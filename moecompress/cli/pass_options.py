"""A pass's command-line options, generated from its config dataclass (:mod:`moecompress.passes.options`): each
field declared with :func:`~moecompress.passes.options.option` becomes one click option whose destination is the
field's name, and :func:`config_from_options` turns the parsed values back into the config."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Iterable
from typing import Any

import click

from ..passes.options import FIELD_DEFAULT, Option, choices_of, field_default, flag_of, option_of, value_type
from .common_options import RenamedOption

GENERATED = "moecompress_config_field"
"""Attribute set on every generated click option: ``(config class name, field name)``."""


def _cli_fields(
    cls: type, only: Iterable[str] | None, exclude: Iterable[str], overrides: dict[str, dict[str, Any]]
) -> list[tuple[dataclasses.Field, Option]]:
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted((set(only or ()) | set(exclude) | set(overrides)) - set(names))
    if unknown:
        raise TypeError(f"{cls.__name__} has no field {unknown[0]}")
    chosen = []
    for field in dataclasses.fields(cls):
        declared = option_of(field)
        if declared is None:
            raise TypeError(f"{cls.__name__}.{field.name} declares no option (moecompress.passes.options)")
        if field.name in overrides:
            declared = declared.with_changes(**overrides[field.name])
        wanted = field.name in only if only is not None else declared.cli and field.name not in exclude
        if wanted and not declared.shared:
            chosen.append((field, declared))
    return chosen


def _click_type(cls: type, field: dataclasses.Field, declared: Option) -> Any:
    base, _ = value_type(cls, field)
    choices = choices_of(cls, field, declared)
    if choices is not None:
        return click.Choice([str(choice) for choice in choices])
    if declared.min is not None or declared.max is not None:
        kind = click.IntRange if base is int else click.FloatRange
        return kind(min=declared.min, max=declared.max, min_open=declared.min_open)
    if base in (int, float):
        return base
    return None


def _cli_default(field: dataclasses.Field, declared: Option) -> Any:
    default = field_default(field) if declared.cli_default is FIELD_DEFAULT else declared.cli_default
    if isinstance(default, tuple):
        return ",".join(map(str, default))
    if isinstance(default, int) and not isinstance(default, bool) and declared.choices is not None:
        return str(default)
    return default


def _click_option(cls: type, field: dataclasses.Field, declared: Option) -> click.Option:
    base, _ = value_type(cls, field)
    flag = flag_of(field, declared)
    default = _cli_default(field, declared)
    attrs: dict[str, Any] = {"help": declared.help, "required": declared.required}
    if base is bool and "/" not in flag:
        attrs["is_flag"] = True
    elif not declared.required:
        attrs["default"] = default
        attrs["show_default"] = default is not None and default != "" and "/" not in flag
    if not attrs.get("is_flag"):
        click_type = _click_type(cls, field, declared)
        if click_type is not None:
            attrs["type"] = click_type
    made = RenamedOption([flag, field.name], old=declared.old, **attrs)
    setattr(made, GENERATED, (cls.__name__, field.name))
    return made


class _Deferred:
    """Stands in a command's parameter list for a pass's options until the list is first read."""

    def __init__(self, pass_name: str, only: Iterable[str] | None, exclude: Iterable[str], overrides: dict) -> None:
        self.pass_name, self.only, self.exclude, self.overrides = pass_name, only, tuple(exclude), overrides

    def options(self) -> list[click.Option]:
        from ..passes.registry import PASSES

        cls = PASSES[self.pass_name].config
        only = None if self.only is None else set(self.only)
        return [_click_option(cls, f, declared) for f, declared in _cli_fields(cls, only, self.exclude, self.overrides)]


class PassCommand(click.Command):
    """A command whose pass options (:func:`config_options`) are generated when its parameters are first read
    (parsing, ``--help``), so that importing the command line imports no pass (nor torch)."""

    @property  # type: ignore[override]
    def params(self) -> list[click.Parameter]:
        if any(isinstance(param, _Deferred) for param in self._params):
            self._params = [
                option
                for param in self._params
                for option in (param.options() if isinstance(param, _Deferred) else [param])
            ]
        return self._params

    @params.setter
    def params(self, value: list[click.Parameter]) -> None:
        self._params = value


def config_options(
    pass_name: str,
    *,
    only: Iterable[str] | None = None,
    exclude: Iterable[str] = (),
    overrides: dict[str, dict[str, Any]] | None = None,
) -> Callable:
    """A decorator adding the registered pass ``pass_name``'s command-line fields as options, in field order, to a
    :class:`PassCommand`; ``only``/``exclude`` pick fields, ``overrides`` changes a field's
    :class:`~moecompress.passes.options.Option` for this command."""

    def apply(command: Callable) -> Callable:
        params = getattr(command, "__click_params__", [])
        params.append(_Deferred(pass_name, only, exclude, overrides or {}))
        command.__click_params__ = params
        return command

    return apply


def _from_cli(cls: type, field: dataclasses.Field, value: Any) -> Any:
    base, _ = value_type(cls, field)
    if typing.get_origin(base) is tuple:
        return tuple(item.strip() for item in value.split(",") if item.strip())
    if base is int and isinstance(value, str):
        return int(value)
    return value


def config_from_options(cls: type, options: dict[str, Any], *, only: Iterable[str] | None = None, **given: Any) -> Any:
    """``cls`` from a command's parsed options: the values of its generated and shared options (``only`` those
    fields, if given) are taken out of ``options`` (shared ones are read, not removed); a value None where the field
    takes none leaves the field's default; ``given`` sets fields directly (a nested config)."""
    values = dict(given)
    for field in dataclasses.fields(cls):
        declared = option_of(field)
        skipped = field.name in given or (only is not None and field.name not in only)
        if skipped or declared is None or field.name not in options:
            continue
        value = options[field.name] if declared.shared else options.pop(field.name)
        if value is None and not value_type(cls, field)[1]:
            continue
        values[field.name] = _from_cli(cls, field, value)
    return cls(**values)
