"""The last word on a finished answer: does it hold to the constraint as the user wrote it?

The grammar engine holds an answer to a grammar built from the user's constraint (for a schema, after
`grammar.closed`'s rewrite); a gap between the two (a rewrite that widened, a keyword the engine holds only
approximately) would otherwise reach the user as a `stop` answer that does not validate. So before an answer
is reported `stop` it is checked here by code that shares nothing with the grammar: a JSON schema by the
`jsonschema` package against the user's own schema (formats as annotations, as JSON Schema's default
vocabulary has them), a JSON object by `json`, a choice by equality. Regular expressions and Lark grammars
have no second implementation of their dialect here and are left to the engine.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from ..constraints import parse


@functools.lru_cache(maxsize=64)
def _validator(spec_text: str) -> Any:
    """A jsonschema validator of the constraint's own schema (its dialect from `$schema`, 2020-12 without)."""
    import jsonschema

    _, schema = parse(spec_text)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema)


def violation(spec_text: str, text: str) -> str | None:
    """Why `text` does not hold to the canonical constraint `spec_text` (`spec.canonical`), or None where it
    does (or where the constraint's kind has no independent check)."""
    kind, body = parse(spec_text)
    if kind == "choice":
        return None if text in body else "the answer is not one of the choices"
    if kind not in ("json", "json_object"):
        return None
    try:
        value = json.loads(text)
    except ValueError as e:
        return f"the answer is not JSON ({e})"
    if kind == "json_object":
        return None if isinstance(value, dict) else "the answer is not a JSON object"
    import jsonschema

    try:
        error = jsonschema.exceptions.best_match(_validator(spec_text).iter_errors(value))
    except Exception as e:  # a pattern Python's re cannot read, an unresolvable reference, ...
        return f"the schema cannot be checked ({type(e).__name__}: {str(e)[:200]})"
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path)
    return f"the answer does not validate against the schema{f' at {where}' if where else ''}: {error.message[:300]}"
