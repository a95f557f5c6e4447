"""Errors a user can act on.

Every failure that reaches a user is a :class:`TuneDeckError`: one message saying what went wrong and where,
and optionally a hint saying what to do next. The CLI prints these without a traceback; the app shows them
in the window.
"""

from __future__ import annotations


class TuneDeckError(Exception):
    """A failure with a message meant for the user."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  hint: {self.hint}"


class ConfigError(TuneDeckError):
    """A configuration value is missing, out of range or of the wrong type."""


class DataError(TuneDeckError):
    """A dataset file cannot be read or one of its rows is unusable."""

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        row: int | None = None,
        field: str | None = None,
        hint: str | None = None,
    ) -> None:
        where = ", ".join(
            part
            for part in (
                f"file {path}" if path else "",
                f"row {row}" if row is not None else "",
                f"field '{field}'" if field else "",
            )
            if part
        )
        super().__init__(f"{where}: {message}" if where else message, hint)
        self.path = path
        self.row = row
        self.field = field


class ModelLoadError(TuneDeckError):
    """A model cannot be found, downloaded or loaded."""
