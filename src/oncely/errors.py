"""The exception hierarchy: every error oncely raises on purpose is an :class:`OncelyError`.

Each class's docstring is its default message, so ``raise DevstackError()`` still says what
went wrong; pass a message to add the specifics (what was wrong and what to do).
"""

from __future__ import annotations


class OncelyError(Exception):
    """oncely failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class ConfigurationError(OncelyError):
    """oncely is configured wrongly."""


class DevstackError(OncelyError):
    """The local development stack could not be started or reached."""


class ToolMissingError(DevstackError):
    """A program the local development stack needs is not installed."""
