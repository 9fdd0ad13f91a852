"""Errors the user can fix. The CLI prints a :class:`UserError` as one line and exits 2; any other
exception is a bug and keeps its traceback."""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input (config, data, files, launch); the message says what and where."""


class ConfigError(UserError, ValueError):
    """A configuration problem; the message names the file, the dotted field path and what was expected.

    (Also a ``ValueError``: pydantic validators raise it, and callers that catch ValueError keep working.)
    """


class MissingFileError(UserError, FileNotFoundError):
    """A file or directory the user named (model, adapter, checkpoint) is missing or incomplete."""


class MissingTensorError(UserError, KeyError):
    """A tensor the user's checkpoint should hold is not in it."""

    def __str__(self) -> str:  # the message as written (KeyError would quote it)
        return str(self.args[0]) if self.args else ""
