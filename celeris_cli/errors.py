"""Errors a user can cause. Each carries a message meant to be shown as-is.

Only the CLI turns these into exit codes and `Error: ...` lines; library code raises them.
"""

from __future__ import annotations


class CelerisError(Exception):
    """Base class: the message is displayed to the user, without a traceback."""

    exit_code = 1


class UsageError(CelerisError):
    """A bad option value, a bad request parameter, a prompt that does not fit."""

    exit_code = 2


class ModelError(CelerisError):
    """A model folder that is missing, incomplete or inconsistent."""

    exit_code = 2


class ConfigError(CelerisError):
    """An invalid YAML config; the message names the key."""

    exit_code = 2


class DeviceError(CelerisError):
    """A device or dtype the machine cannot provide."""

    exit_code = 2
