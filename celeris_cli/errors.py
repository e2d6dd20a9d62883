"""Errors a user can cause. Each carries a message meant to be shown as-is.

Only the CLI turns these into exit codes and `Error: ...` lines; library code raises them. The queue
turns them into failure records: the exception's type carries the record's `code` and whether a retry
can help (`retryable`), so nothing ever classifies an error by reading its message.
"""

from __future__ import annotations

# Exit codes, the same for every command (the README's "Exit codes" table).
EXIT_OK = 0
EXIT_FAILED = 1  # some requests failed, or the work itself did (a download, a checksum)
EXIT_USAGE = 2  # a usage, config, model or device error: nothing was run
EXIT_IO = 74  # sysexits EX_IOERR: the filesystem refused a queue's claim, publish or retry (full disk)
EXIT_LOCKED = 75  # sysexits EX_TEMPFAIL: another instance holds the queue; try again later
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM (`kill`, `timeout`, systemd): finished answers kept, as for Ctrl-C


class CelerisError(Exception):
    """Base class: the message is displayed to the user, without a traceback."""

    exit_code = EXIT_FAILED
    code = "error"  # the failure code a queue records for a request that raised this
    retryable = False  # a user's mistake is never retryable: the same request fails the same way


class UsageError(CelerisError):
    """A bad option value, a bad request parameter, a prompt that does not fit."""

    exit_code = EXIT_USAGE
    code = "bad_param"


class PromptTooLong(UsageError):
    """A prompt that, with its generation length, does not fit the model's context."""

    code = "prompt_too_long"


class InvalidText(UsageError):
    """Text that cannot be tokenized, such as a lone UTF-16 surrogate in a prompt or an id."""

    code = "invalid_utf8"


class TooLarge(CelerisError):
    """A request that does not fit the memory it may use even alone (out of memory, or over --max-memory)."""

    code = "too_large"


class ModelError(CelerisError):
    """A model folder that is missing, incomplete or inconsistent."""

    exit_code = EXIT_USAGE
    code = "model_error"


class ConfigError(CelerisError):
    """An invalid YAML config; the message names the key."""

    exit_code = EXIT_USAGE
    code = "config_error"


class DeviceError(CelerisError):
    """A device or dtype the machine cannot provide."""

    exit_code = EXIT_USAGE
    code = "device_error"


class QueueIOError(CelerisError):
    """The filesystem refused a write a queue command needs (a full disk, a read-only folder)."""

    exit_code = EXIT_IO
    code = "io_error"
