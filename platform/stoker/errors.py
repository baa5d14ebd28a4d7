"""Errors of the control plane that reach a user."""

from __future__ import annotations


class CLIError(Exception):
    """A user-facing command-line error: printed as one line, exit status 1."""
