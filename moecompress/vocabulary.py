"""Options named as their caller spells them: ``--flag`` on the command line, the key's path in a recipe
(``passes[1].quantize.lowrank_budget``), the argument (``lowrank_budget=``) in the Python API.

An :class:`~moecompress.errors.OptionError` holds a template naming options by their declared names (:func:`named`
writes the placeholders); the layer that knows its caller sets the vocabulary that renders it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from .errors import OptionError, UserInputError

PLACEHOLDER = re.compile(r"\{(?:(calibration|evaluation|run)\.)?([a-z_]+)(?:=([^{}]*))?\}")
_MISSING = object()


def named(name: str, value: Any = _MISSING) -> str:
    """The placeholder for option ``name`` (``section.name`` for calibration and evaluation; ``run.name`` for how
    a run is asked for: ``run.overwrite``, ``run.resume``, ...), with ``value`` as given where it is worth showing
    (``named("run.overwrite", True)``: ``--overwrite`` on the command line, ``overwrite=True`` in the API)."""
    if value is _MISSING:
        return "{" + name + "}"
    if isinstance(value, tuple):
        value = ",".join(map(str, value))
    text = str(value).replace("{", "(").replace("}", ")")
    return "{" + name + "=" + text + "}"


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class Vocabulary:
    """How one kind of caller spells an option of ``owner`` (a config class, or ``"calibration"`` /
    ``"evaluation"``)."""

    def name(self, owner: Any, key: str) -> str:
        raise NotImplementedError

    def value(self, owner: Any, key: str, value: str) -> str:
        return f"{self.name(owner, key)} {value}"

    def for_pass(self, index: int) -> Vocabulary:
        """The vocabulary of the recipe's ``index``-th compressing pass (a recipe's keys differ per pass)."""
        return self

    def render(self, template: str, owner: Any) -> str:
        def one(match: re.Match) -> str:
            section, key, value = match.groups()
            who = section or owner
            return self.name(who, key) if value is None else self.value(who, key, value)

        return PLACEHOLDER.sub(one, template)

    def bind(self, error: UserInputError, index: int | None = None) -> UserInputError:
        """``error`` spelled in this vocabulary (for pass ``index`` of a recipe) where it names options."""
        if isinstance(error, OptionError):
            error.spelled(self if index is None else self.for_pass(index))
        return error


CALIBRATION_FLAGS = {
    "source": "--calib",
    "tokens": "--calib-tokens",
    "seq_len": "--seq-len",
    "seed": "--seed",
    "image_size": "--image-size",
}
EVALUATION_FLAGS = {"data": "--eval-data", "tokens": "--eval-tokens"}
"""The command line's flags for the run's calibration and evaluation settings: the commands declare their options
with these (:mod:`moecompress.cli.common_options`), and messages name them so."""


class CommandLine(Vocabulary):
    def _declared(self, owner: Any, key: str) -> tuple[str, bool]:
        """The flag (``--yes/--no`` pairs whole) and whether it is an on/off switch."""
        from .passes.options import flag_of, option_of, value_type

        fields = {f.name: f for f in dataclasses.fields(owner)} if dataclasses.is_dataclass(owner) else {}
        field = fields.get(key)
        declared = option_of(field) if field is not None else None
        if declared is None:
            return "--" + key.replace("_", "-"), False
        if not declared.cli and not declared.shared:
            return key, False
        return flag_of(field, declared), value_type(owner, field)[0] is bool

    def name(self, owner: Any, key: str) -> str:
        if owner == "calibration":
            return CALIBRATION_FLAGS.get(key, "--" + key.replace("_", "-"))
        if owner == "evaluation":
            return EVALUATION_FLAGS.get(key, "--" + key.replace("_", "-"))
        if owner == "run":
            return "--" + key.replace("_", "-")
        return self._declared(owner, key)[0].split("/")[0]

    def value(self, owner: Any, key: str, value: str) -> str:
        if owner == "run" and value == "True":
            return self.name(owner, key)
        if isinstance(owner, str):
            return f"{self.name(owner, key)} {value}"
        flag, switch = self._declared(owner, key)
        if switch and value in ("True", "False"):
            on, _, off = flag.partition("/")
            return on if value == "True" else (off or f"no {on}")
        return f"{flag.split('/')[0]} {value}"


class RecipeKeys(Vocabulary):
    """A recipe's key paths: ``sections`` maps an owner (or ``(owner, key)``) to its path, per pass in ``passes``."""

    def __init__(
        self, sections: dict[Any, str], passes: list[dict[Any, str]] | None = None, invoker: Vocabulary | None = None
    ):
        self.sections, self.passes = sections, passes or []
        self.invoker = invoker
        """How the recipe's runner spells the run's own options (``run.overwrite``); None: the command line."""

    def invoked_by(self, invoker: Vocabulary) -> RecipeKeys:
        return RecipeKeys(self.sections, self.passes, invoker)

    def for_pass(self, index: int) -> Vocabulary:
        if index >= len(self.passes):
            return self
        return RecipeKeys({**self.sections, **self.passes[index]}, self.passes, self.invoker)

    def name(self, owner: Any, key: str) -> str:
        if owner == "run":
            return (self.invoker or COMMAND_LINE).name(owner, key)
        exact = self.sections.get((owner, key))
        if exact is not None:
            return exact
        path = self.sections.get(owner)
        return key if path is None else f"{path}.{key}"

    def value(self, owner: Any, key: str, value: str) -> str:
        if owner == "run":
            return (self.invoker or COMMAND_LINE).value(owner, key, value)
        yaml_value = {"True": "true", "False": "false", "None": "null"}.get(value, value)
        return f"{self.name(owner, key)} {yaml_value}"


class Arguments(Vocabulary):
    """The Python API's keyword arguments; the calibration's and evaluation's fields are keys of the
    ``calibration=`` and ``evaluation=`` dicts unless ``renames`` makes them arguments of their own."""

    def __init__(self, caller: str, renames: dict[tuple[str, str], str] | None = None):
        self.caller, self.renames = caller, renames or {}

    def render(self, template: str, owner: Any) -> str:
        return f"{self.caller}(): " + super().render(template, owner)

    def name(self, owner: Any, key: str) -> str:
        if (owner, key) in self.renames:
            return self.renames[(owner, key)] + "="
        if isinstance(owner, str) and owner != "run":
            return f"{owner}['{key}']"
        return f"{key}="

    def value(self, owner: Any, key: str, value: str) -> str:
        shown = value if _number(value) or value in ("True", "False", "None") else repr(value)
        if isinstance(owner, str) and owner != "run" and (owner, key) not in self.renames:
            return f"{owner}={{'{key}': {shown}}}"
        return f"{self.name(owner, key)}{shown}"


COMMAND_LINE = CommandLine()
