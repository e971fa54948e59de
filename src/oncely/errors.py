"""The exception hierarchy: every error oncely raises on purpose is an :class:`OncelyError`.

Each class's docstring is its default message, so ``raise DevstackError()`` still says what
went wrong; pass a message to add the specifics (what was wrong and what to do).
"""

from __future__ import annotations


class OncelyError(Exception):
    """oncely failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


MAX_ERROR_TEXT = 4000
"""The most characters of an error's text oncely stores (a DLQ header, a dead row, a task)."""


def error_text(error: BaseException | str) -> str:
    """``Type: message`` of an error (or the text as is), cut to :data:`MAX_ERROR_TEXT`
    characters: how oncely stores an error's text."""
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return text[:MAX_ERROR_TEXT]


class ConfigurationError(OncelyError):
    """oncely is configured wrongly."""


class DevstackError(OncelyError):
    """The local development stack could not be started or reached."""


class ToolMissingError(DevstackError):
    """A program the local development stack needs is not installed."""
