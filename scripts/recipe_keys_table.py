"""Write docs/recipe_keys.md: every registered pass's recipe keys with their type, default, command-line flag and
help, from the config dataclasses' declarations (moecompress/passes/options.py). ``--check`` exits 1 when the file
differs from what the declarations give (tests/test_pass_options.py runs it)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from moecompress.cli.main import app
from moecompress.cli.pass_options import PassCommand
from moecompress.passes.options import (
    choices_of,
    field_default,
    flag_of,
    option_of,
    range_text,
    type_name,
    value_type,
)
from moecompress.passes.registry import PASSES
from moecompress.vocabulary import RecipeKeys

OUT = Path(__file__).parent.parent / "docs" / "recipe_keys.md"

HEAD = """# Recipe keys and command-line options

Each pass's parameters are declared once, on its config dataclass (`moecompress/passes/`): the field's name is the
recipe key, and the same declaration gives the command's flag, its default and its help. This file is written from
those declarations by `python scripts/recipe_keys_table.py` (do not edit it by hand; `tests/test_pass_options.py`
fails when it is out of date).

A recipe sets a key as `- quantize: {scheme: int4, group_size: 64}`; `lowrank` sets the quantize pass's low-rank
keys (`lowrank_budget`, `rank_alloc`, ...) right after it. *recipe only* marks a tuning knob the commands leave at
its default. A pass's `seed` defaults to the recipe's `calibration.seed`. A key marked *Only with ...* is refused
where the pass's other keys leave it unused (`gptq_damp` with `method: rtn`), on the command line and in the API
too; leaving it out is always accepted. A value outside a key's range or choices (the *type* column) is refused
before any work, naming the key in a recipe, the flag on the command line and the argument in the API; a key's
default is always accepted (`lowrank_rank`'s 0: no adapters).
"""


def _value(value: Any) -> str:
    if isinstance(value, str):
        return f"`{value}`"
    if isinstance(value, tuple):
        return f"`{json.dumps(list(value))}`"
    if dataclasses.is_dataclass(value):
        return "see below"
    return f"`{json.dumps(value)}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _commands() -> dict[str, list[str]]:
    commands: dict[str, list[str]] = {}
    for name, command in app.commands.items():
        if isinstance(command, PassCommand):
            for pass_name in command.pass_names:
                commands.setdefault(pass_name, []).append(name)
    return commands


def _rows(cls: type, command: str | None) -> list[str]:
    rows = ["| key | type | default | flag | what it sets |", "|---|---|---|---|---|"]
    for field in dataclasses.fields(cls):
        declared = option_of(field)
        kind = type_name(cls, field)
        choices = choices_of(cls, field, declared)
        if choices is not None and "one of" not in kind:
            kind = "one of " + ", ".join(map(str, choices)) + (" or null" if value_type(cls, field)[1] else "")
        bounds = range_text(declared)
        if bounds is not None:
            kind += f"; {bounds}"
        nested = value_type(cls, field)[0]
        if dataclasses.is_dataclass(nested):
            kind = f"mapping of {nested.__name__} keys"
            inner = {f.name: f for f in dataclasses.fields(nested)}
            flags = [flag_of(inner[name], option_of(inner[name])).split("/")[0] for name in declared.nested]
            flag = ", ".join(f"`{name}`" for name in flags) or "recipe only"
        elif not declared.cli:
            flag = "recipe only"
        else:
            flag = "`" + flag_of(field, declared).replace("/", "` / `") + "`"
            if declared.shared:
                flag += f" (the {command} command's own)" if command else ""
        what = declared.help
        if declared.applies is not None:
            what += f" Only with {RecipeKeys({}).render(declared.applies.text, cls)}; refused elsewhere."
        rows.append(f"| `{field.name}` | {_cell(kind)} | {_value(field_default(field))} | {flag} | {_cell(what)} |")
    return rows


def render() -> str:
    commands = _commands()
    parts = [HEAD]
    for name, entry in PASSES.items():
        on = commands.get(name, [])
        where = f"; command `moecompress {on[0]}`" if on else "; recipes only"
        parts.append(f"## `{name}`: {entry.help}{where}\n")
        parts.append("\n".join(_rows(entry.config, on[0] if on else None)) + "\n")
        for field in dataclasses.fields(entry.config):
            nested = value_type(entry.config, field)[0]
            if dataclasses.is_dataclass(nested):
                default, plain = field_default(field), nested()
                changed = {f.name: getattr(default, f.name) for f in dataclasses.fields(nested)}
                changed = {k: v for k, v in changed.items() if v != getattr(plain, k)}
                parts.append(
                    f"`{name}.{field.name}` takes the keys of `{nested.__name__}` (the `quantize` pass above), "
                    f"whose defaults it changes to {', '.join(f'{k}: {_value(v)}' for k, v in changed.items())}.\n"
                )
    return "\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is out of date instead of writing")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python scripts/recipe_keys_table.py", file=sys.stderr)
            sys.exit(1)
        return
    OUT.write_text(text)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
