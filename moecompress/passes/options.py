"""Each pass option is declared once, on its config dataclass's field: the field's name is the recipe key, its type
and default are the recipe's, and :func:`option` in the field's metadata gives the command line its flag, help,
choices and range. :mod:`moecompress.cli.pass_options` turns a config class into click options from this, and
``scripts/recipe_keys_table.py`` writes docs/recipe_keys.md from it.

```python
gptq_damp: float = field(default=0.01, metadata=option("GPTQ: ...", min=0, min_open=True))
gptq_block: int = field(default=128, metadata=recipe_only("GPTQ's column block width."))
```

This module does not import click, so the passes (and ``import moecompress``) stay light.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import OptionError
from ..vocabulary import named

OPTION_KEY = "moecompress.option"


class _FieldDefault:
    def __repr__(self) -> str:
        return "the field's default"


FIELD_DEFAULT: Any = _FieldDefault()


@dataclass(frozen=True)
class When:
    """Where a field is used: ``test(config)`` says whether the config's other values use it, ``text`` says when
    it does, naming the fields it tests as :func:`~moecompress.vocabulary.named` placeholders."""

    text: str
    test: Callable[[Any], bool]


@dataclass(frozen=True)
class Option:
    """How a config field appears on the command line (``cli=False``: a recipe key only)."""

    help: str
    flag: str | None = None
    """``--name`` (underscores as dashes) unless given; ``--yes/--no`` makes a boolean an on/off pair."""
    choices: tuple[Any, ...] | None = None
    """The values the flag takes (else a ``Literal`` field's values); ints are typed as their digits."""
    min: float | None = None
    max: float | None = None
    min_open: bool = False
    max_open: bool = False
    cli_default: Any = FIELD_DEFAULT
    """The flag's default where it differs from the field's (None: "not given", resolved by the command)."""
    required: bool = False
    old: tuple[str, ...] = ()
    """Old spellings, still accepted and hidden from ``--help``."""
    shared: bool = False
    """Set from the command's own option of the same flag (``--seq-len``), which is not generated here."""
    cli: bool = True
    nested: tuple[str, ...] = ()
    """For a field holding another config (QAT's ``quantize``): the fields of that config the command line sets."""
    nested_changes: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """How those nested fields' options differ on this pass's command (another default, required, help)."""
    applies: When | None = None
    """Where the field is used (None: always); given where it is not, it is refused (:func:`refuse_unused`)."""

    def with_changes(self, **changes: Any) -> Option:
        return dataclasses.replace(self, **changes)


def option(help: str, **attrs: Any) -> dict[str, Option]:
    """A field's metadata: it is a command-line option (see :class:`Option` for ``attrs``)."""
    return {OPTION_KEY: Option(help, **attrs)}


def recipe_only(help: str, **attrs: Any) -> dict[str, Option]:
    """A field's metadata: a recipe key with no command-line flag (a tuning knob the commands leave at its default)."""
    return {OPTION_KEY: Option(help, cli=False, **attrs)}


def option_of(field: dataclasses.Field) -> Option | None:
    return field.metadata.get(OPTION_KEY)


def declared_fields(cls: type) -> list[tuple[dataclasses.Field, Option | None]]:
    """Every field of ``cls`` with its declaration (None where it has none: a mistake the tests catch)."""
    return [(f, option_of(f)) for f in dataclasses.fields(cls)]


def nested_configs(cls: type) -> dict[str, type]:
    """The fields of config class ``cls`` that hold a whole config of their own, by name (QAT's ``quantize``)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])}


def flag_of(field: dataclasses.Field, declared: Option) -> str:
    return declared.flag or "--" + field.name.replace("_", "-")


def flag(cls: type, name: str) -> str:
    """The command-line flag of ``cls``'s field ``name`` (for messages that name it)."""
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    declared = option_of(field)
    if declared is None:
        raise KeyError(f"{cls.__name__}.{name} declares no option")
    return flag_of(field, declared).split("/")[0]


def field_default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def value_type(cls: type, field: dataclasses.Field) -> tuple[Any, bool]:
    """The field's type without ``None`` and whether None is allowed."""
    annotation = typing.get_type_hints(cls)[field.name]
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Union or type(annotation).__name__ == "UnionType":
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else annotation), type(None) in args
    return annotation, False


def choices_of(cls: type, field: dataclasses.Field, declared: Option) -> tuple[Any, ...] | None:
    if declared.choices is not None:
        return declared.choices
    base, _ = value_type(cls, field)
    if typing.get_origin(base) is typing.Literal:
        return typing.get_args(base)
    return None


def type_name(cls: type, field: dataclasses.Field) -> str:
    """The field's type as a recipe writer reads it."""
    base, optional = value_type(cls, field)
    origin = typing.get_origin(base)
    if origin is typing.Literal:
        name = "one of " + ", ".join(map(str, typing.get_args(base)))
    elif origin is tuple:
        name = f"list of {typing.get_args(base)[0].__name__}"
    elif dataclasses.is_dataclass(base):
        name = "mapping"
    else:
        name = getattr(base, "__name__", str(base))
    return f"{name} or null" if optional else name


def refuse_unused(config: Any, given: Iterable[str], nested: Mapping[str, Iterable[str]] | None = None) -> None:
    """Refuse an option the caller gave (``given``: field names; ``nested``: the given names of a nested config's
    fields) that ``config``'s other values leave unused, e.g. ``gptq_damp`` with ``method`` rtn. Defaults are not
    given, so only what a caller wrote is refused."""
    given = set(given)
    for field, declared in declared_fields(type(config)):
        if declared is None:
            continue
        inner = getattr(config, field.name)
        if nested and field.name in nested and dataclasses.is_dataclass(inner):
            refuse_unused(inner, nested[field.name])
        if field.name in given and declared.applies is not None and not declared.applies.test(config):
            raise OptionError(
                f"{named(field.name, inner)} applies only with {declared.applies.text}; it would be ignored here",
                type(config),
            )


KINDS = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}
"""What a value of each plain field type is, as a refusal names it."""


def kind_problem(value: Any, base: Any) -> str | None:
    """Why ``value`` is not of the field type ``base`` (None if it is; Literal values are left to the choices)."""
    origin = typing.get_origin(base)
    if origin is typing.Literal:
        return None
    if origin is tuple:
        if not isinstance(value, tuple):
            return "is not a list"
        item = typing.get_args(base)[0]
        return next((f"(item {i}) {p}" for i, v in enumerate(value) if (p := kind_problem(v, item))), None)
    if dataclasses.is_dataclass(base):
        return None if isinstance(value, base) else f"is not a {base.__name__}"
    fits = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }.get(base, True)
    return None if fits else f"is not {KINDS[base]}"


def _number(value: float) -> str:
    return f"{value:g}"


def range_text(declared: Option) -> str | None:
    """The declared range as a refusal states it (``at least 1``, ``between 0 and 1 (exclusive)``, ``in (0, 1]``)."""
    low, high = declared.min, declared.max
    if low is None and high is None:
        return None
    if high is None:
        return f"{'above' if declared.min_open else 'at least'} {_number(low)}"
    if low is None:
        return f"{'below' if declared.max_open else 'at most'} {_number(high)}"
    if declared.min_open == declared.max_open:
        return f"between {_number(low)} and {_number(high)}" + (" (exclusive)" if declared.min_open else "")
    opening, closing = "(" if declared.min_open else "[", ")" if declared.max_open else "]"
    return f"in {opening}{_number(low)}, {_number(high)}{closing}"


def in_range(value: float, declared: Option) -> bool:
    low, high = declared.min, declared.max
    below = low is not None and (value <= low if declared.min_open else value < low)
    above = high is not None and (value >= high if declared.max_open else value > high)
    return not (below or above)


def field_problem(cls: type, field: dataclasses.Field, declared: Option, value: Any) -> str | None:
    """Why ``value`` breaks ``field``'s declaration: its type, a finite number, its choices, its range. The field's
    default is always accepted (``lowrank_rank``'s 0 is "no adapters", outside the range a caller may set)."""
    base, optional = value_type(cls, field)
    if value is None and optional:
        return None
    problem = kind_problem(value, base)
    if problem is not None:
        return problem
    if isinstance(value, float) and not math.isfinite(value):
        return "is not a finite number"
    if value == field_default(field) and type(value) is type(field_default(field)):
        return None
    choices = choices_of(cls, field, declared)
    if choices is not None and value not in choices:
        return f"is not one of {', '.join(map(str, choices))}"
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not in_range(value, declared):
        return f"must be {range_text(declared)}"
    return None


def check_declared(config: Any) -> None:
    """Refuse any field of ``config`` (nested configs included) that breaks its declaration: type, finite number,
    choices, range. Every entry runs it (the configs' ``validate()``) before any work, so the command line, recipes
    and the API refuse the same values, each in its own spelling of the option."""
    cls = type(config)
    for field, declared in declared_fields(cls):
        value = getattr(config, field.name)
        if declared is None:
            continue
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_declared(value)
            continue
        refuse_breaking(cls, field, declared, value)


def refuse_breaking(cls: type, field: dataclasses.Field, declared: Option, value: Any) -> None:
    """The refusal of ``value`` for ``cls``'s ``field`` where it breaks the declaration (``declared``: the field's
    own, or the one a command changed)."""
    problem = field_problem(cls, field, declared, value)
    if problem is not None:
        shown = value if isinstance(value, (bool, int, float, tuple)) or value is None else short(value)
        raise OptionError(f"{named(field.name, shown)} {problem}", cls)


def short(value: Any) -> str:
    """``value`` for a one-line message: a string as it is, anything else as its repr, at most 60 characters."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
