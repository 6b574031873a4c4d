"""Exceptions and warnings of the trace format.

``TraceError`` subclasses ``ValueError`` because a bad trace is bad *input*: the CLI maps
``ValueError`` to exit code 2 with its one-line message, and callers that already catch
``ValueError`` for malformed input need nothing new. Every message is one line that starts with
the path of the offending file, then (where it applies) the step, and says what is wrong.
"""

from __future__ import annotations

__all__ = ["TraceError", "TraceWarning", "MALFORMED"]


class TraceError(ValueError):
    """A trace that cannot be read as asked: ``"<file>: [step N: ]<what is wrong>"``."""


MALFORMED = (IndexError, ValueError, TypeError, KeyError)
"""What reading a malformed view raises where a well-formed one would not (a wrong dtype, shape or
length, a missing key): the figures draw a message for it, explain notes it and goes on."""


class TraceWarning(UserWarning):
    """A recoverable problem found on open (for example a dropped partial trailing step).

    The same text is kept in ``Trace.warnings`` so that notebooks can show it after the fact.
    """
