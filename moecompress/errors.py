"""The one error type that reaches users as a one-line message and exit code 2."""


class UserInputError(Exception):
    """Bad input from the user: a missing path, an unsupported model, a corrupt file.

    The CLI prints ``str(error)`` on one line and exits with code 2.
    """
