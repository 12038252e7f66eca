"""The one error type that reaches users as a one-line message and exit code 2."""

from __future__ import annotations

from typing import Any


class UserInputError(Exception):
    """Bad input from the user: a missing path, an unsupported model, a corrupt file.

    The CLI prints ``str(error)`` on one line and exits with code 2.
    """


class OptionError(UserInputError):
    """A refusal that names options by their declared names, so each caller reads them as it wrote them: ``--flag``
    on the command line, the key's path in a recipe, ``name=`` in the API (:mod:`moecompress.vocabulary`).

    ``template`` writes ``{field}`` for a field of ``owner`` (a config class), ``{calibration.tokens}`` or
    ``{evaluation.tokens}`` for the run's calibration and evaluation, and ``{field=value}`` for the option with the
    value given. Until a caller's layer sets :attr:`vocabulary`, it reads as the command line spells it.
    """

    def __init__(self, template: str, owner: Any = None):
        super().__init__(template)
        self.template, self.owner = template, owner
        self.vocabulary: Any = None

    def spelled(self, vocabulary: Any) -> OptionError:
        self.vocabulary = vocabulary
        return self

    def __str__(self) -> str:
        from .vocabulary import COMMAND_LINE

        return (self.vocabulary or COMMAND_LINE).render(self.template, self.owner)
