"""The one exception type the CLI turns into a one-line message and exit code 2."""


class UserError(Exception):
    """Bad input from the user: the message says what is wrong and what to do."""

    exit_code = 2
