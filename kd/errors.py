"""The one error type for user mistakes (the CLI prints its message on one line and exits 2), and
the near names a refusal suggests."""

import difflib
from typing import Iterable


def suggest(name: str, choices: Iterable[str], n: int = 3) -> str:
    """' (did you mean a, b?)' for close matches of ``name`` in ``choices``, else ''."""
    close = difflib.get_close_matches(name, list(choices), n=n, cutoff=0.6)
    return f" (did you mean {', '.join(close)}?)" if close else ""


class KDError(Exception):
    """A problem with the user's input (options, recipe, data, weights, environment).

    Raise it with a message that says what is wrong and, where possible, what to do.
    Anything else that escapes is a bug in kd and keeps its traceback.
    """

    def __init__(self, *args):
        # raised in a DataLoader worker (a prepared copy's damaged image), it is made again in the run's
        # process from the worker's whole traceback (torch's ExceptionWrapper): its own line is kept
        if len(args) == 1 and isinstance(args[0], str) and args[0].startswith("Caught "):
            head, _, traceback = args[0].partition("\nOriginal Traceback")
            if traceback and " in DataLoader worker process " in head:
                args = (traceback.rstrip().rsplit("\n", 1)[-1].split(": ", 1)[-1],)
        super().__init__(*args)


class NonFinite(KDError):
    """A run's loss stayed NaN/inf (``--max-nonfinite-steps``), decided alike on every process: with
    several students in one run it stops that student only."""
