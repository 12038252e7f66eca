"""Options that mean the same thing on every command, declared once: the calibration source and size, the window
length, and the evaluation. Old spellings (``--data`` for the calibration source of qat and prune-heads,
``--max-tokens`` and ``--data`` of eval) stay accepted, hidden from ``--help``, for one release."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from ..defaults import (
    CALIBRATION_LEAST,
    DEFAULT_CALIB_TOKENS,
    DEFAULT_DATA,
    DEFAULT_EVAL_DATA,
    DEFAULT_EVAL_TOKENS,
    DEFAULT_SEQ_LEN,
    DEVICE_CHOICES,
    EVAL_TOKENS_LEAST,
)
from ..vocabulary import CALIBRATION_FLAGS, EVALUATION_FLAGS


class RenamedOption(click.Option):
    """An option that also answers to ``old`` spellings, which ``--help`` does not show."""

    def __init__(self, param_decls: list[str], *, old: tuple[str, ...] = (), **attrs: Any):
        names = [decl for decl in param_decls if decl.startswith("-")]
        dest = [decl for decl in param_decls if not decl.startswith("-")]
        super().__init__([*names, *old, *dest], **attrs)
        self.old_names = old

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        with self._current_names_only():
            return super().get_help_record(ctx)

    def get_error_hint(self, ctx: click.Context) -> str:
        with self._current_names_only():
            return super().get_error_hint(ctx)

    @contextlib.contextmanager
    def _current_names_only(self) -> Iterator[None]:
        saved = self.opts
        self.opts = [name for name in self.opts if name not in self.old_names]
        try:
            yield
        finally:
            self.opts = saved


class EvalTokens(click.ParamType):
    """A token count of at least :data:`~moecompress.defaults.EVAL_TOKENS_LEAST`, or ``all``."""

    name = "N|all"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int | None:
        if value is None or (isinstance(value, str) and value.lower() == "all"):
            return None
        try:
            number = int(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a whole number or 'all'", param, ctx)
        if number < EVAL_TOKENS_LEAST:
            self.fail(f"{number} is less than {EVAL_TOKENS_LEAST}", param, ctx)
        return number


EVAL_TOKENS_HELP = (
    f"Tokens evaluated (whole windows of --seq-len from the start of the held-out text), or 'all'; the default "
    f"{DEFAULT_EVAL_TOKENS} is the same for every command and recipe."
)


def out_option(
    help: str = "Output directory (written atomically; must not exist unless --overwrite).", required: bool = True
) -> Callable:
    return click.option(
        "--out", "out_dir", required=required, type=click.Path(file_okay=False, path_type=Path), help=help
    )


def overwrite_option(help: str = "Replace an existing output directory.") -> Callable:
    return click.option("--overwrite", is_flag=True, help=help)


def calib_option(help: str, default: str = DEFAULT_DATA, old: tuple[str, ...] = ()) -> Callable:
    return click.option(
        CALIBRATION_FLAGS["source"], "calib", cls=RenamedOption, old=old, default=default, show_default=True, help=help
    )


def _calibration_count_option(field: str, default: int, help: str) -> Callable:
    """The calibration option ``field`` (``CALIBRATION_FLAGS``' spelling): a whole number, at least
    ``CALIBRATION_LEAST[field]``."""
    return click.option(
        CALIBRATION_FLAGS[field],
        type=click.IntRange(min=CALIBRATION_LEAST[field]),
        default=default,
        show_default=True,
        help=help,
    )


def calib_tokens_option(
    help: str = "Calibration tokens (whole windows of --seq-len, sampled with --seed).",
) -> Callable:
    return _calibration_count_option("tokens", DEFAULT_CALIB_TOKENS, help)


def seq_len_option(help: str = "Tokens per window of calibration, training and evaluation.") -> Callable:
    return _calibration_count_option("seq_len", DEFAULT_SEQ_LEN, help)


def eval_options(data_help: str, no_eval_help: str | None = None) -> Callable:
    """``--eval-data``, ``--eval-tokens`` and ``--no-eval``, with the defaults recipes use too."""

    def apply(command: Callable) -> Callable:
        command = click.option(
            "--no-eval",
            is_flag=True,
            help=no_eval_help or "Skip the evaluation (a forward of the output and of the input, one layer at a time).",
        )(command)
        command = click.option(
            EVALUATION_FLAGS["tokens"],
            type=EvalTokens(),
            default=str(DEFAULT_EVAL_TOKENS),
            show_default=True,
            help=EVAL_TOKENS_HELP,
        )(command)
        return click.option(EVALUATION_FLAGS["data"], default=DEFAULT_EVAL_DATA, show_default=True, help=data_help)(
            command
        )

    return apply


def _check_device(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    from ..device import parse_device

    if value is not None:
        parse_device(value, "--device")
        value = value.strip().lower()
    ctx.meta["moecompress.device"] = value
    return value


def device_option(command: Callable) -> Callable:
    """``--device``: where the layers compute; checked (a bad value, or CUDA where torch sees none) while the
    options are parsed, before any work. Commands read it with :func:`chosen_device`."""
    return click.option(
        "--device",
        default=None,
        metavar=DEVICE_CHOICES,
        expose_value=False,
        callback=_check_device,
        help="Where each layer's calibration and the passes' math run: auto (the default: CUDA when torch sees "
        "one, else the CPU), cpu, cuda or cuda:N; a recipe's device: unless given. Weights are read and written "
        "on the host, one layer at a time on the device.",
    )(command)


def chosen_device() -> str | None:
    """The command's ``--device`` (checked; ``cuda`` stays ``cuda``, each torchrun rank's own GPU), or None where it
    was not given."""
    return click.get_current_context().meta.get("moecompress.device")


SECTION_FIELDS = {
    "calib": ("calibration", "source"),
    "calib_tokens": ("calibration", "tokens"),
    "seq_len": ("calibration", "seq_len"),
    "image_size": ("calibration", "image_size"),
    "eval_data": ("evaluation", "data"),
    "eval_tokens": ("evaluation", "tokens"),
}
"""The shared options that set the run's calibration and evaluation, by parameter name."""


def refuse_unused_common(passes: list[tuple[str, Any]], evaluating: bool, source: str) -> None:
    """Refuse the shared options the command line gave that the run would ignore: ``--eval-data`` and
    ``--eval-tokens`` with ``--no-eval``, calibration options where no pass calibrates
    (:func:`~moecompress.runner.recipes.refuse_unused_calibration`)."""
    from click.core import ParameterSource

    from ..errors import OptionError
    from ..runner.recipes import refuse_unused_calibration
    from ..vocabulary import named

    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return
    given: dict[str, set[str]] = {"calibration": set(), "evaluation": set()}
    for param in ctx.command.params:
        source_of = ctx.get_parameter_source(param.name) if param.name in SECTION_FIELDS else None
        if source_of not in (None, ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP):
            section, key = SECTION_FIELDS[param.name]
            given[section].add(key)
    for key in sorted(given["evaluation"]):
        if not evaluating:
            raise OptionError(f"{named('evaluation.' + key)} applies only with an evaluation; --no-eval skips it")
    refuse_unused_calibration(passes, evaluating, given["calibration"], source)
