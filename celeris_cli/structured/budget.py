"""What a constraint may cost before the grammar engine sees it, checked by arithmetic on its text.

A regular expression of a hundred bytes can ask the grammar engine for a million states: `(a{1000}){1000}` or
`a{1000000}` burn llguidance's whole lexer fuel (seconds of work) before it gives up, and below its limit a
counted repetition of 100,000 still costs about 150 ms a mask, on the decoding thread. So every regular
expression of a constraint (a `regex`, a schema's `pattern`s and `patternProperties` names, a Lark grammar's
/.../ terminals) is sized first: the positions its counted repetitions expand to (the upper count, or the
lower where there is none, times what they repeat, nested counts multiplied), at most `MAX_EXPANSION`.
JSONSchemaBench's 9,620 patterns expand to at most 8,394 (`scripts`-free: `celeris bench structured --suite`
reports what it refuses), so the limit refuses none of them. Whatever passes is still built under llguidance's
own fuel (`grammar.limits`), and before the request is admitted (`grammar.check`).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from typing import Any

from ..errors import UsageError

MAX_EXPANSION = 10_000
_PROPERTY_CLASS = re.compile(r"\\[pP]\{[^}]*\}|\\[pP][A-Za-z]")  # \p{L}: Rust's, not Python's
_COUNT = re.compile(r"\{(\d+)(?:,(\d*))?\}")
_LARK_REGEX = re.compile(r"/((?:[^/\\\n]|\\.)+)/[imslux]*")


def expansion(pattern: str) -> int:
    """The positions a regular expression's counted repetitions expand to (an upper bound where Python's
    parser cannot read it: the product of every count in it)."""
    import re._constants as c  # type: ignore[import-not-found]
    import re._parser as p  # type: ignore[import-not-found]

    def size(items: Any) -> int:
        total = 0
        for op, av in items:
            if op in (c.MAX_REPEAT, c.MIN_REPEAT, getattr(c, "POSSESSIVE_REPEAT", None)):
                lo, hi, sub = av
                total += max(hi if hi != c.MAXREPEAT else lo, 1) * size(sub)
            elif op == c.SUBPATTERN:
                total += size(av[-1])
            elif op == c.BRANCH:
                total += max(size(b) for b in av[1])
            elif op in (c.ASSERT, c.ASSERT_NOT):
                total += size(av[1])
            else:
                total += 1
        return total

    try:
        with warnings.catch_warnings():  # "possible nested set": a warning about Python's future syntax
            warnings.simplefilter("ignore", FutureWarning)
            return size(p.parse(_PROPERTY_CLASS.sub(".", pattern)))
    except Exception:  # a syntax Python lacks: every count multiplied, an upper bound
        out = 1
        for lo, hi in _COUNT.findall(pattern):
            out *= max(int(hi or lo or 1), 1)
            if out > MAX_EXPANSION:
                break
        return max(out, len(pattern))


def check_regex(name: str, pattern: str) -> None:
    n = expansion(pattern)
    if n > MAX_EXPANSION:
        raise UsageError(
            f"{name}: its counted repetitions expand to {n} positions, over the limit of {MAX_EXPANSION} "
            "(the grammar engine would build a state for each)"
        )


def _patterns(schema: Any, where: str) -> Iterator[tuple[str, str]]:
    """(location, regex) of every pattern of a schema; values (`const`, `enum`, ...) are not walked."""
    todo = [(schema, where)]
    while todo:
        v, at = todo.pop()
        if isinstance(v, dict):
            for k, x in v.items():
                if k == "pattern" and isinstance(x, str):
                    yield f"{at}.pattern", x
                elif k == "patternProperties" and isinstance(x, dict):
                    yield from ((f"{at}.patternProperties", key) for key in x)
                    todo.extend((sub, f"{at}.patternProperties.{key}") for key, sub in x.items())
                elif k not in ("const", "enum", "default", "examples"):
                    todo.append((x, f"{at}.{k}"))
        elif isinstance(v, list):
            todo.extend((x, f"{at}.{i}") for i, x in enumerate(v))


def check_budget(kind: str, body: Any) -> None:
    """Refuse, naming where, a constraint whose regular expressions expand past `MAX_EXPANSION`."""
    name = f"structured_outputs.{kind}"
    if kind == "regex":
        check_regex(name, body)
    elif kind == "json":
        for at, pattern in _patterns(body, name):
            check_regex(at, pattern)
    elif kind == "grammar":
        for m in _LARK_REGEX.finditer(body):
            check_regex(f"{name} (/{m.group(1)[:40]}/)", m.group(1))
