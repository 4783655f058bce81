"""The one exception type for problems the user can fix."""


class UserError(Exception):
    """A bad input (config, file, path). The CLI prints it as one line, without a traceback."""
