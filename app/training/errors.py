"""errors: what can go wrong in a training request, in the categories the Tinker SDK knows.

The SDK sorts a failed request into `user` (the caller's input is wrong: retrying the same
request cannot help) or `server` (our fault or a transient condition). A request refused
before it is queued answers with an HTTP status (`http_status`); one that fails while it runs
fails its future with `{"error": ..., "category": ...}`. Either way the message says what was
wrong and how to fix it, and nothing in the model has changed.

Not here: turning these into HTTP responses (http.py).
"""

from __future__ import annotations

from weightsync.errors import WeightsyncError


class TrainingError(WeightsyncError):
    """Root of the training service's errors."""

    category = "server"
    http_status = 500


class UserInputError(TrainingError, ValueError):
    """The request is malformed or asks for something impossible (bad shapes, unknown loss)."""

    category = "user"
    http_status = 400


class AuthError(TrainingError, PermissionError):
    """Missing or wrong API key."""

    category = "user"
    http_status = 401


class NotFound(TrainingError, KeyError):
    """An unknown model, session, checkpoint or request id."""

    category = "user"
    http_status = 404

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class NotSupported(NotFound):
    """A route or option this server does not implement: 404 naming the feature, never a
    silently wrong answer."""


class SessionFinished(UserInputError):
    """A request in a session its client finished (`ServiceClient.close`, or leaving its `with`
    block): 410, on which the SDK stops that session's heartbeat."""

    http_status = 410
