"""The one error type for user mistakes. The CLI prints its message on one line and exits 2."""


class KDError(Exception):
    """A problem with the user's input (options, recipe, data, weights, environment).

    Raise it with a message that says what is wrong and, where possible, what to do.
    Anything else that escapes is a bug in kd and keeps its traceback.
    """


class NonFinite(KDError):
    """A run's loss stayed NaN/inf (``--max-nonfinite-steps``), decided alike on every process: with
    several students in one run it stops that student only."""
