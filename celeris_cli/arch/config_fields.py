"""A config.json value checked by the annotation of the dataclass field it fills (no torch: the config modules
read it before any model is built)."""

from __future__ import annotations

from typing import Any

from ..errors import ModelError

_KINDS: dict[str, tuple[tuple[type, ...], str]] = {
    "int": ((int,), "an integer"),
    "float": ((int, float), "a number"),
    "bool": ((bool,), "true or false"),
}


def check_type(key: str, value: Any, annotation: str) -> None:
    """A config.json value checked by its dataclass annotation ("int", "float | None", ...), naming the key."""
    kind, optional = annotation.replace(" | None", ""), annotation.endswith("| None")
    if kind not in _KINDS or (optional and value is None):
        return
    types, name = _KINDS[kind]
    if not isinstance(value, types) or (isinstance(value, bool) and kind != "bool"):
        raise ModelError(f"config.json: {key} must be {name}, got {value!r}")
