"""What `celeris serve` is started with: where it listens, who may call it, and its limits.

Security as a server must: loopback by default; any other address needs an API key (from a file, never
the command line) unless the user says `--insecure-no-auth`. Keys are compared in constant time and never
logged.
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from ..constraints import MAX_SPEC_CHARS
from ..errors import UsageError


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 1 << 20  # a JSON request body
    max_file_bytes: int = 100 << 20  # an uploaded batch file
    max_tokens: int = 512  # max_tokens (gen_length) of one request
    max_batch_lines: int = 50_000  # requests in one batch file
    max_concurrent: int = 256  # requests waiting or decoding at once; more get 429
    batch_size: int = 16  # rows decoded together
    max_constraint_chars: int = MAX_SPEC_CHARS  # a request's structured_outputs / response_format, canonical text


@dataclass(frozen=True)
class Keys:
    """The API keys a request may present (none: no authentication)."""

    keys: tuple[bytes, ...] = ()

    @classmethod
    def from_file(cls, path: Path) -> Keys:
        """One key per non-empty line (several allow a rotation)."""
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--api-key-file: cannot read {path} ({e.__class__.__name__})") from None
        keys = tuple(line.strip().encode() for line in text.splitlines() if line.strip())
        if not keys:
            raise UsageError(f"--api-key-file: {path} holds no key")
        return cls(keys)

    @property
    def required(self) -> bool:
        return bool(self.keys)

    def accepts(self, authorization: str | None) -> bool:
        """Whether an `Authorization: Bearer KEY` header holds a key; every key is compared, in constant time."""
        if not self.keys:
            return True
        scheme, _, given = (authorization or "").partition(" ")
        token = given.strip().encode()
        ok = False
        for key in self.keys:
            ok |= hmac.compare_digest(token, key)
        return ok and scheme.lower() == "bearer"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name other than localhost may resolve anywhere


def check_exposure(host: str, keys: Keys, insecure_no_auth: bool) -> None:
    """Refuse to listen beyond this machine without a key, unless the user asked for exactly that."""
    if keys.required and insecure_no_auth:
        raise UsageError("--insecure-no-auth and --api-key-file contradict each other; give one")
    if not is_loopback(host) and not keys.required and not insecure_no_auth:
        raise UsageError(
            f"--host {host} is reachable from other machines: give --api-key-file FILE, or "
            "--insecure-no-auth to serve without authentication"
        )
