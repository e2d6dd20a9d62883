"""Schema coverage over a benchmark folder (`celeris bench structured --suite FOLDER`): which JSON schemas
Celeris accepts, beside which llguidance alone compiles, per subset, and whether the grammar Celeris builds
holds each schema's own test instances.

A folder holds JSONSchemaBench's files (github.com/guidance-ai/jsonschemabench, `maskbench/data`: one JSON file
per schema, `{"schema": ..., "tests": [{"data": ..., "valid": bool}, ...]}`, named `SUBSET---NAME.json`), or
plain schema files in one subfolder per subset. Per schema:

- llguidance alone: the schema as given, compiled by llguidance with its own default options and limits
  (`LLMatcher.validate_grammar` over the model's vocabulary);
- Celeris: the schema as a request's `structured_outputs` (its size bound, `constraints`) built the way a
  request is admitted (`structured.grammar.check`: the rewrite, the compile budget, the first steps);
- each test instance, written compact, fed to Celeris's grammar: an invalid instance it accepts is a gap
  (the grammar allows what the schema forbids); a valid one it refuses is expected where the grammar narrows
  (objects closed to other keys, keys in the declared order).

No model weights are needed: only the model folder's tokenizer.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ..errors import CelerisError, UsageError

MAX_SCHEMAS = 20_000
MAX_FILE_BYTES = 4 << 20


def suite_files(folder: Path) -> list[tuple[str, Path]]:
    """(subset, file) for every schema file in `folder`, in name order."""
    if not folder.is_dir():
        raise UsageError(f"--suite: {folder} is not a folder")
    out = []
    for path in sorted(folder.rglob("*.json")):
        subset = path.name.split("---")[0] if "---" in path.name else path.parent.name
        out.append((subset, path))
    if not out:
        raise UsageError(f"--suite: {folder} holds no .json file")
    if len(out) > MAX_SCHEMAS:
        raise UsageError(f"--suite: at most {MAX_SCHEMAS} schema files, {folder} holds {len(out)}")
    return out


def _read(path: Path) -> tuple[Any, list[tuple[Any, bool]]] | None:
    """(schema, [(instance, valid)]) of one file, None where it is not a schema file this reads."""
    if path.stat().st_size > MAX_FILE_BYTES:
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        return None
    if isinstance(data, dict) and "schema" in data and isinstance(data.get("tests", []), list):
        tests = [(t["data"], bool(t["valid"])) for t in data.get("tests", []) if isinstance(t, dict) and "data" in t]
        return data["schema"], tests
    return (data, []) if isinstance(data, dict | bool) else None


def llguidance_alone(schema: Any, vocab: Any) -> bool:
    """Whether llguidance compiles the schema as given, with its defaults."""
    from llguidance import LLMatcher

    try:
        grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema))
    except (ValueError, TypeError, RecursionError):
        return False
    error = LLMatcher.validate_grammar(grammar, vocab.llg)
    return not error or error.startswith("WARNING")


def celeris_accepts(schema: Any, vocab: Any) -> tuple[str | None, str | None]:
    """(the canonical constraint, None) where Celeris admits the schema, else (None, why not)."""
    from ..constraints import canonical
    from ..structured.grammar import check

    try:
        spec = canonical("structured_outputs", {"json": schema})
        assert spec is not None
        check(spec, vocab)
    except CelerisError as e:
        return None, str(e)
    return spec, None


def holds(spec: str, instance: Any, vocab: Any) -> bool:
    """Whether Celeris's grammar of `spec` accepts `instance`, written compact, as a whole answer."""
    from ..structured.grammar import built

    text = json.dumps(instance, separators=(",", ":"), ensure_ascii=False)
    tokens = vocab.tokens_of(text)
    if b"".join(vocab.tokens[t] for t in tokens) != text.encode():
        return False  # no token of this vocabulary spells some byte of it
    matcher = built(spec, vocab)
    return bool(matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting())


def vocabulary_of(model: Any) -> Any:
    """The grammar engine's view of a model folder's tokenizer, as a request is checked against it (the queue's
    `Preparer.load`: no weights)."""
    from ..arch.folder import ModelFolder
    from ..engine import model_dir
    from ..structured.grammar import vocabulary

    folder = ModelFolder.open(model_dir(model))
    tokenizer = folder.tokenizer()
    return vocabulary(tokenizer, folder.cfg.rows, frozenset(folder.extra_stops | {tokenizer.pad_id}))


def coverage(folder: Path, vocab: Any, limit: int | None = None) -> dict[str, Any]:
    """Per subset: schemas read, compiled by llguidance alone, accepted by Celeris, accepted by one and not the
    other, and the test instances Celeris's grammar holds (valid ones accepted, invalid ones accepted)."""
    files = suite_files(folder)[:limit]
    subsets: dict[str, dict[str, Any]] = {}
    t0 = time.perf_counter()
    for subset, path in files:
        read = _read(path)
        row = subsets.setdefault(subset, dict.fromkeys(_COUNTS, 0) | {"refused": {}})
        if read is None:
            row["unread"] += 1
            continue
        schema, tests = read
        row["schemas"] += 1
        alone = llguidance_alone(schema, vocab)
        spec, why = celeris_accepts(schema, vocab)
        row["llguidance"] += alone
        row["celeris"] += spec is not None
        if alone and spec is None:
            row["only_llguidance"] += 1
            row["refused"][path.name] = (why or "")[:200]
        row["only_celeris"] += spec is not None and not alone
        if spec is None:
            continue
        for instance, valid in tests:
            key = "valid" if valid else "invalid"
            row[f"{key}_tests"] += 1
            if holds(spec, instance, vocab):
                row[f"{key}_held"] += 1
                if not valid:
                    row["refused"][f"{path.name} (accepts an invalid instance)"] = json.dumps(instance)[:200]
    total = dict.fromkeys(_COUNTS, 0)
    for row in subsets.values():
        for k in _COUNTS:
            total[k] += row[k]
    return {"folder": str(folder), "subsets": subsets, "total": total, "wall_s": round(time.perf_counter() - t0, 1)}


_COUNTS = ("schemas", "unread", "llguidance", "celeris", "only_llguidance", "only_celeris", "valid_tests",
           "valid_held", "invalid_tests", "invalid_held")  # fmt: skip


def render_coverage(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"schema coverage over {report['folder']} ({report['wall_s']} s)")
    for c in ("subset", "schemas", "llguidance alone", "celeris", "only llguidance", "valid held", "invalid held"):
        table.add_column(c)

    def pct(a: int, b: int) -> str:
        return f"{a} ({100 * a / b:.1f}%)" if b else "0"

    rows = [*report["subsets"].items(), ("total", report["total"])]
    for name, r in rows:
        n = r["schemas"]
        table.add_row(
            name, str(n), pct(r["llguidance"], n), pct(r["celeris"], n), str(r["only_llguidance"]),
            f"{r['valid_held']}/{r['valid_tests']}", f"{r['invalid_held']}/{r['invalid_tests']}",
        )  # fmt: skip
    Console(width=max(Console().width, 120)).print(table)
