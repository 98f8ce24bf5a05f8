"""The one exception type for mistakes a user can fix."""


class UserError(Exception):
    """Reported as one line `error: <message>`, exit code 2, no traceback.

    Raised only when nothing was changed on disk (or everything already written was restored), so the
    message can say what to do next without a caveat."""
