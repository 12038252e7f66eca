"""A pass's command-line options, generated from its config dataclass (:mod:`moecompress.passes.options`): each
field declared with :func:`~moecompress.passes.options.option` becomes one click option whose destination is the
field's name, and :func:`config_from_options` turns the parsed values back into the config. A field holding another
config (QAT's ``quantize``) contributes the nested config's fields it names (``Option.nested``)."""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import click
from click.core import ParameterSource

from ..passes.options import (
    FIELD_DEFAULT,
    Option,
    choices_of,
    field_default,
    flag_of,
    option_of,
    refuse_breaking,
    refuse_unused,
    value_type,
)
from .common_options import RenamedOption

GENERATED = "moecompress_config_field"
"""Attribute set on every generated click option: ``(config class name, field name)``."""

Generated = tuple[type, dataclasses.Field, Option]


def _declared(cls: type, field: dataclasses.Field) -> Option:
    declared = option_of(field)
    if declared is None:
        raise TypeError(f"{cls.__name__}.{field.name} declares no option (moecompress.passes.options)")
    return declared


def _nested_class(cls: type, field: dataclasses.Field) -> type | None:
    base, _ = value_type(cls, field)
    return base if dataclasses.is_dataclass(base) else None


def _cli_fields(
    cls: type, only: Iterable[str] | None, exclude: Iterable[str], changes: dict[str, dict[str, Any]]
) -> list[Generated]:
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted((set(only or ()) | set(exclude) | set(changes)) - set(names))
    if unknown:
        raise TypeError(f"{cls.__name__} has no field {unknown[0]}")
    chosen: list[Generated] = []
    for field in dataclasses.fields(cls):
        declared = _declared(cls, field)
        if field.name in changes:
            declared = declared.with_changes(**changes[field.name])
        wanted = field.name in only if only is not None else declared.cli and field.name not in exclude
        nested = _nested_class(cls, field)
        if not wanted or declared.shared:
            continue
        if nested is not None:
            chosen += _cli_fields(nested, declared.nested, (), declared.nested_changes)
        else:
            chosen.append((cls, field, declared))
    return chosen


class FiniteFloat(click.FloatRange):
    """A float (in a range, where given) that is not NaN nor infinite."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value} is not a finite number", param, ctx)
        return super().convert(number, param, ctx)


class _Declared:
    """A generated option's type: a value that breaks the field's declaration is refused with the recipe's and the
    API's :class:`~moecompress.errors.OptionError` (:func:`~moecompress.passes.options.refuse_breaking`), naming the
    flag; click's base class shows the choices or the range in ``--help``."""

    def declare(self, generated: Generated, parse: click.ParamType) -> _Declared:
        self.generated, self.parse = generated, parse
        return self

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        typed = self.parse.convert(value, param, ctx)
        refuse_breaking(*self.generated, typed)
        return str(typed) if isinstance(self, click.Choice) else typed


class DeclaredChoice(_Declared, click.Choice):
    """Reads its choices on each use, so a scheme registered after the commands were built is offered."""

    def __init__(self, choices: Sequence[Any]) -> None:
        super().__init__(choices)
        self._source = choices

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(str(choice) for choice in self._source)

    @choices.setter
    def choices(self, value: Sequence[Any]) -> None:
        self._source = value


class DeclaredFloat(_Declared, FiniteFloat):
    pass


class DeclaredInt(_Declared, click.IntRange):
    pass


def _click_type(cls: type, field: dataclasses.Field, declared: Option) -> Any:
    base, _ = value_type(cls, field)
    generated = (cls, field, declared)
    choices = choices_of(cls, field, declared)
    parse = click.INT if base is int else click.FLOAT if base is float else click.STRING
    if choices is not None:
        return DeclaredChoice(choices).declare(generated, parse)
    bounds = dict(min=declared.min, max=declared.max, min_open=declared.min_open, max_open=declared.max_open)
    if base is float:
        return DeclaredFloat(**bounds).declare(generated, parse)
    if base is int:
        return DeclaredInt(**bounds).declare(generated, parse)
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

    def __init__(self, pass_name: str, only: Iterable[str] | None, exclude: Iterable[str], changes: dict) -> None:
        self.pass_name, self.only, self.exclude, self.changes = pass_name, only, tuple(exclude), changes

    def options(self) -> list[click.Option]:
        from ..passes.registry import PASSES

        cls = PASSES[self.pass_name].config
        only = None if self.only is None else set(self.only)
        return [_click_option(*generated) for generated in _cli_fields(cls, only, self.exclude, self.changes)]


class PassCommand(click.Command):
    """A command whose pass options (:func:`config_options`) are generated when its parameters are first read
    (parsing, ``--help``), so that importing the command line imports no pass (nor torch). ``pass_names``: the
    registered passes whose options it generates."""

    @property  # type: ignore[override]
    def params(self) -> list[click.Parameter]:
        if any(isinstance(param, _Deferred) for param in self._params):
            params = [
                option
                for param in self._params
                for option in (param.options() if isinstance(param, _Deferred) else [param])
            ]
            names = [param.name for param in params]
            twice = sorted({name for name in names if names.count(name) > 1})
            if twice:
                raise TypeError(f"{self.name}: options {twice} are declared twice")
            self._params = params
        return self._params

    @params.setter
    def params(self, value: list[click.Parameter]) -> None:
        self._params = value
        self.pass_names = [param.pass_name for param in value if isinstance(param, _Deferred)]


def config_options(
    pass_name: str,
    *,
    only: Iterable[str] | None = None,
    exclude: Iterable[str] = (),
    changes: dict[str, dict[str, Any]] | None = None,
) -> Callable:
    """A decorator adding the registered pass ``pass_name``'s command-line fields as options, in field order, to a
    :class:`PassCommand`; ``only``/``exclude`` pick fields, ``changes`` alters a field's
    :class:`~moecompress.passes.options.Option` for this command."""

    def apply(command: Callable) -> Callable:
        params = getattr(command, "__click_params__", [])
        params.append(_Deferred(pass_name, only, exclude, changes or {}))
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


def _values(cls: type, options: dict[str, Any], only: Iterable[str] | None) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        declared = _declared(cls, field)
        nested = _nested_class(cls, field)
        if only is not None and field.name not in only:
            continue
        if nested is not None and declared.nested:
            values[field.name] = dataclasses.replace(field_default(field), **_values(nested, options, declared.nested))
            continue
        if field.name not in options:
            continue
        value = options[field.name] if declared.shared else options.pop(field.name)
        if value is not None or value_type(cls, field)[1]:
            values[field.name] = _from_cli(cls, field, value)
    return values


def given_options() -> dict[str, set[str]]:
    """Per config class name, the fields whose generated options the current command line gave (not defaults)."""
    ctx = click.get_current_context(silent=True)
    given: dict[str, set[str]] = {}
    if ctx is None:
        return given
    for param in ctx.command.params:
        generated = getattr(param, GENERATED, None)
        source = ctx.get_parameter_source(param.name) if param.name else None
        if generated is not None and source not in (None, ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP):
            given.setdefault(generated[0], set()).add(generated[1])
    return given


def config_from_options(cls: type, options: dict[str, Any]) -> Any:
    """``cls`` from a command's parsed options: the values of its generated options are taken out of ``options``
    (a shared option's value is read, not taken); a value None where the field takes none leaves the field's
    default; a nested config is its field's default with the nested options' values. An option the command line
    gave that the config's other values leave unused is refused (:func:`~moecompress.passes.options.refuse_unused`)."""
    config = cls(**_values(cls, options, None))
    given = given_options()
    nested = {
        field.name: given.get(type(getattr(config, field.name)).__name__, set())
        for field in dataclasses.fields(cls)
        if dataclasses.is_dataclass(getattr(config, field.name))
    }
    refuse_unused(config, given.get(cls.__name__, set()), nested)
    return config
