"""Turn a user's mistake into one plain line at the command line; leave genuine bugs their traceback.

A user error is one of the project's typed input errors (a trace, window, artifact or setting that cannot
work), a missing file, invalid settings, or a server that cannot be reached. Everything else is a bug and
keeps its traceback, so it can be reported.
"""

from __future__ import annotations

from pydantic import ValidationError
from sqlalchemy.exc import OperationalError

from switchyard.services.artifacts import ArtifactError
from switchyard.services.calibration import WindowError
from switchyard.services.refit import RefitError
from switchyard.shared.errors import ConfigError, RemoteError
from switchyard.shared.routing_trace import TraceError
from switchyard.solver.eldr_fit import FitError
from switchyard.solver.placement.problem import PlacementError
from switchyard.solver.scoring import ScoringError
from switchyard.solver.signatures import SignatureError

#: Raised by the project when the input, not the code, is wrong.
INPUT_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError,
    TraceError,
    FitError,
    WindowError,
    RefitError,
    ArtifactError,
    SignatureError,
    ScoringError,
    PlacementError,
    RemoteError,
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
    ConnectionError,  # also what Bus.connect raises when NATS cannot be reached in time
)


def _causes(exc: BaseException) -> list[BaseException]:
    """The exception, the ones it was raised from, and the members of exception groups, outermost first."""
    seen: list[BaseException] = []
    stack = [exc]
    while stack:
        current = stack.pop(0)
        if current in seen:
            continue
        seen.append(current)
        if isinstance(current, BaseExceptionGroup):
            stack.extend(current.exceptions)
        if current.__cause__ is not None:
            stack.append(current.__cause__)
    return seen


def user_error_message(exc: BaseException) -> str | None:
    """One line that names what the user got wrong, or None when `exc` looks like a bug."""
    for cause in _causes(exc):
        if isinstance(cause, ValidationError):
            first = cause.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or cause.title
            return f"invalid setting {where}: {first['msg']}"
        if isinstance(cause, OperationalError):
            reason = str(cause.orig or cause).strip().splitlines()[0]
            return f"cannot use the database: {reason}"
        if isinstance(cause, OSError) and not isinstance(cause, INPUT_ERRORS):
            continue
        if isinstance(cause, INPUT_ERRORS):
            text = " ".join(str(cause).split()) or type(cause).__name__
            return text
    return None
