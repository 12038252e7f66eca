"""``--trust-remote-code`` and ``--allow-pickle``, shared by every command that reads a model."""

from __future__ import annotations

from collections.abc import Callable

import click

from ..trust import CURRENT


def _set(attribute: str):
    def callback(ctx: click.Context, param: click.Parameter, value: bool) -> None:
        if value:
            setattr(CURRENT, attribute, True)

    return callback


def trust_options(command: Callable) -> Callable:
    command = click.option(
        "--allow-pickle",
        is_flag=True,
        expose_value=False,
        callback=_set("pickle"),
        help="Read pickle weights (.bin/.pt), with torch.load(weights_only=True); refused without this flag.",
    )(command)
    return click.option(
        "--trust-remote-code",
        is_flag=True,
        expose_value=False,
        callback=_set("remote_code"),
        help="Let transformers run the model's own Python code (auto_map) when it loads the model or tokenizer.",
    )(command)
