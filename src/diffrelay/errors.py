"""The one exception type for problems the user can fix."""


class UserError(Exception):
    """A bad input (config, file, path). The CLI prints it as one line, without a traceback."""


class GroupFailure(UserError):
    """Another rank died or stalled: this rank's collective failed or timed out."""
