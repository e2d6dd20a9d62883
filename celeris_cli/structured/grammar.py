"""The grammar engine (llguidance) over a model's vocabulary: a constraint's canonical text (`spec`) compiled
once per request, and per row a matcher that says which tokens may come next.

Why llguidance: it compiles a JSON schema, a regular expression or a Lark grammar about 50x faster than
xgrammar (no precomputation over the vocabulary: a new schema starts at once), keeps raw control characters
out of JSON strings, and is one wheel without dependencies; xgrammar computes a mask faster over a 150k
vocabulary (docs/benchmarks.md, `scripts/mask-cost`), while on the embedded models' 9,280 tokens
llguidance's masks cost tens of microseconds. Both take any vocabulary as byte strings and report forced
tokens.

A token's bytes are the text it adds to an answer (`Tokenizer.continuation`): sentencepiece's ▁ is a
space, its byte pieces (<0x7B>) are their byte, byte-level BPE's Ġ-alphabet maps back to bytes; special
tokens have none and are never allowed, except that every stop token is allowed wherever the grammar may
end. Where two tokens spell the same bytes, the ordinary piece is preferred over the byte piece when the
engine forces text (a JSON key, a closing quote).

JSON is compiled compact, with no whitespace between its tokens (`JSON_OPTIONS`): unbounded whitespace
would let a model spend its whole answer on blanks, and with none the grammar alone decides every key,
quote and separator of a schema's fixed parts, which the commit rule then lays down without the model
(`Grammar.forced`).
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..arch.tokenizer import Tokenizer
from ..constraints import parse
from ..errors import UsageError
from .budget import check_budget

JSON_OPTIONS: Any = {"whitespace_flexible": False}
BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted: the character byte-level BPE writes for each byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


BYTE_LEVEL = _byte_level_alphabet()


def token_bytes(tok: Tokenizer) -> tuple[list[bytes], list[int]]:
    """Each token's bytes (empty for special ones) and the special tokens' ids."""
    backend: Any = tok.backend
    size = backend.size()
    sp = getattr(backend, "sp", None)
    out: list[bytes] = []
    special: list[int] = []
    hf = getattr(backend, "tok", None)
    added = {i for i, t in hf.get_added_tokens_decoder().items() if t.special} if hf is not None else set()
    sample = [backend.piece(i) or "" for i in range(0, size, max(1, size // 4000))]
    byte_level = hf is not None and sum("Ġ" in p for p in sample) > len(sample) // 50
    metaspace = hf is not None and not byte_level and sum("▁" in p for p in sample) > len(sample) // 50
    for i in range(size):
        piece = backend.piece(i) or ""
        if sp is not None and (sp.is_control(i) or sp.is_unknown(i)) or i in added or i == tok.mask_id:
            out.append(b"")
            special.append(i)
        elif sp is not None and sp.is_byte(i):
            out.append(bytes([int(piece[3:5], 16)]))
        elif sp is not None:
            out.append(piece.replace("▁", " ").encode())
        elif byte_level:
            try:
                out.append(bytes(BYTE_LEVEL[c] for c in piece))
            except KeyError:  # an added, non-special token written as plain text
                out.append(piece.encode())
        elif BYTE_PIECE.fullmatch(piece):  # byte fallback
            out.append(bytes([int(piece[3:5], 16)]))
        elif metaspace:  # ▁ is a space wherever it stands (a piece's end too: Gemma's "e▁")
            out.append(piece.replace("▁", " ").encode())
        else:  # another kind of tokenizer.json (WordPiece): its decoder's text for the token
            out.append(backend.decode([i]).encode())
    return out, special


class _Wrapper:
    """What llguidance's TokenizerWrapper reads: the tokens' bytes and a tokenizer for text it forces
    (greedy longest match over the tokens)."""

    def __init__(self, tokens: list[bytes], special: list[int], eos: int, bos: int | None) -> None:
        self.tokens, self.special_token_ids = tokens, special
        self.eos_token_id, self.bos_token_id = eos, bos
        index: dict[bytes, int] = {}
        for i, b in enumerate(tokens):
            if b:
                index.setdefault(b, i)
        self.index, self.longest = index, max((len(b) for b in index), default=1)

    def __call__(self, text: bytes | str) -> list[int]:
        data = text.encode() if isinstance(text, str) else text
        out, i = [], 0
        while i < len(data):
            for n in range(min(self.longest, len(data) - i), 0, -1):
                t = self.index.get(data[i : i + n])
                if t is not None:
                    out.append(t)
                    i += n
                    break
            else:  # no token spells this byte: the grammar cannot be followed past it (a dead end there)
                return out
        return out


class Vocabulary:
    """A tokenizer as the grammar engine sees it, built once per tokenizer (`vocabulary`)."""

    def __init__(self, tok: Tokenizer, rows: int, stops: frozenset[int] = frozenset()) -> None:
        """stops: the ids that end an answer beyond the tokenizer's own (a model's generation_config.json
        eos ids, the pad token): no text, and allowed only where the grammar may end, as every stop. The
        grammar engine's own tokenizer (`llg`) is built on first use: log probabilities need none."""
        tokens, special = token_bytes(tok)
        ending = (frozenset(tok.stop_ids) | stops) & frozenset(range(len(tokens)))
        for i in sorted(ending - frozenset(special)):  # an ordinary piece a model's config makes a stop
            tokens[i] = b""
            special.append(i)
        sp = getattr(tok.backend, "sp", None)
        wrapper = _Wrapper(tokens, special, tok.eos_id, tok.bos_id)
        if sp is not None:  # prefer ordinary pieces to sentencepiece's byte pieces for forced text
            for i, b in enumerate(tokens):
                if b and not sp.is_byte(i) and len(b) == 1:
                    wrapper.index[b] = i
        self.tokens = tokens
        self.tokens_of = wrapper  # text -> tokens, greedy longest match (what the engine forces text with)
        self.blank = wrapper.index.get(b" ")  # one space: a template slot's filler after its value
        self.size = len(tokens)
        self.rows = rows  # the model's logits: at least the tokenizer's size
        self.stop_ids = sorted(frozenset(tok.stop_ids) | stops)
        self.eos_id = tok.eos_id

    @functools.cached_property
    def llg(self) -> Any:
        """The vocabulary as llguidance holds it (`LLTokenizer`)."""
        llguidance = grammar_engine()
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(self.tokens_of), n_vocab=self.size)

    def text(self, i: int) -> str:
        return self.tokens[i].decode("utf-8", errors="replace") if 0 <= i < self.size else ""


def grammar_engine() -> Any:
    """The llguidance module, imported where a constraint is first used: a machine without it runs everything
    else (issue 59: a GPU machine with no package registry)."""
    try:
        import llguidance
    except ImportError:
        raise UsageError(
            "structured_outputs: the grammar engine, the llguidance package, is not installed "
            "(pip install 'llguidance>=1.3,<2')"
        ) from None
    return llguidance


@functools.lru_cache(maxsize=8)
def vocabulary(tok: Tokenizer, rows: int, stops: frozenset[int] = frozenset()) -> Vocabulary:
    return Vocabulary(tok, rows, stops)


def grammar_of(spec_text: str) -> str:
    """The engine's grammar for a canonical constraint (`spec.canonical`)."""
    LLMatcher = grammar_engine().LLMatcher

    kind, body = parse(spec_text)
    if kind == "json":
        return str(LLMatcher.grammar_from_json_schema(json.dumps(closed(body)), overrides=JSON_OPTIONS))
    if kind == "json_object":
        return str(LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=JSON_OPTIONS))
    if kind == "regex":
        return str(LLMatcher.grammar_from_regex(body))
    if kind == "choice":
        alternatives = " | ".join(json.dumps(c) for c in body)
        return str(LLMatcher.grammar_from_lark(f"start: {alternatives}\n"))
    return str(LLMatcher.grammar_from_lark(body))


_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")  # name -> schema
_SCHEMA_ONE = ("items", "additionalItems", "contains", "then", "else", "propertyNames")
_SCHEMA_LISTS = ("prefixItems", "anyOf")  # alternatives or positions: each a schema of its own
_MERGED = ("allOf", "$ref", "anyOf", "oneOf", "if", "dependentSchemas", "unevaluatedProperties")
# where a narrower sub-schema does not mean a narrower schema: `oneOf` (an answer matching one alternative as
# closed may match two as written), `not` and `if` (narrowing the condition widens the other side), a
# `contains` counted by `maxContains`. Nothing under them is rewritten.
_FROZEN = ("oneOf", "not", "if")


_PLAIN = {"type", "properties", "required", "title", "description"}


def _flattened(schema: dict[str, Any]) -> dict[str, Any]:
    """An object's `allOf` members that only declare properties (the inheritance pattern written inline)
    merged into it: the same documents, as one object that can be closed. Anything else is left as it is."""
    members = schema.get("allOf")
    if not isinstance(members, list) or not all(isinstance(m, dict) and set(m) <= _PLAIN for m in members):
        return schema
    parts = [schema, *members]
    if any(m.get("type", "object") != "object" for m in parts):
        return schema
    props: dict[str, Any] = {}
    for m in parts:
        for name, sub in (m.get("properties") or {}).items():
            if name in props and props[name] != sub:
                return schema  # two declarations of one key: both must hold, which a merge cannot say
            props[name] = sub
    required = list(dict.fromkeys(r for m in parts for r in (m.get("required") or [])))
    out = {k: v for k, v in schema.items() if k != "allOf"}
    if any("type" in m for m in parts):  # a member's `type: object` still holds of the merged object
        out["type"] = "object"
    return {**out, "properties": props} | ({"required": required} if required else {})


def _refers(schema: Any) -> bool:
    """Whether a `$ref` (or `$dynamicRef`) stands anywhere inside `schema` (values are walked too: cheap, and
    a false yes only keeps a schema as written)."""
    todo = [schema]
    while todo:
        v = todo.pop()
        if isinstance(v, dict):
            if "$ref" in v or "$dynamicRef" in v:
                return True
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)
    return False


def _frozen_parts(schema: Any) -> list[Any]:
    """The sub-schemas of `schema` under a keyword where narrowing does not narrow (`_FROZEN`)."""
    out, todo = [], [schema]
    while todo:
        v = todo.pop()
        if isinstance(v, dict):
            for k, sub in v.items():
                counted = k == "contains" and "maxContains" in v
                if k in _FROZEN or counted:
                    out.append(sub)
                elif k not in ("const", "enum", "default", "examples"):
                    todo.append(sub)
        elif isinstance(v, list):
            todo.extend(v)
    return out


def closed(schema: Any) -> Any:
    """The schema with every object that declares its properties and says nothing of others closed to others
    (`additionalProperties: false`, as OpenAI's strict mode demands of every schema): a model is not free to
    invent keys until it runs out of tokens. The rewrite only ever narrows, so an answer under it is valid
    under the schema as given:

    - a key that `required` names and `properties` does not declare is declared with any value (JSON Schema
      allows it; closed without it, the object could not be written);
    - nothing under `oneOf`, `not`, `if` or a counted `contains` is rewritten (`_FROZEN`: there a narrower part
      is not a narrower whole), and where a `$ref` stands under one of them, nothing is rewritten at all (the
      part it names may be closed elsewhere);
    - an object whose properties combine with others' (other `allOf` members, a schema beside `anyOf` or
      `$ref`, ...) is left open: closing each part alone would refuse the keys the other parts declare; so is
      a definition that a `$ref` combines with other parts (`_combined_definitions`);
      `allOf` members that only declare properties are merged into their object first (`_flattened`).

    Only sub-schemas are walked, never data (`const`, `enum`, `default`, `examples` are values)."""
    if any(_refers(part) for part in _frozen_parts(schema)):
        return schema
    combined = _combined_definitions(schema)
    if combined is None:
        return schema
    return _closed(schema, True, combined)


_ANNOTATIONS = {"$ref", "title", "description", "$comment", "default", "examples", "deprecated", "readOnly"}
_DEFINITIONS = ("#/definitions/", "#/$defs/")


def _combined_definitions(schema: Any) -> set[str] | None:
    """The definitions a `$ref` combines with other parts (an `allOf` member, a `$ref` beside other keywords,
    an alternative beside `properties`): each is left open, as an object combined inline is. None where such a
    `$ref` names something other than a definition (then nothing is rewritten)."""
    out: set[str] = set()
    todo: list[tuple[Any, bool]] = [(schema, False)]
    while todo:
        v, joined = todo.pop()
        if isinstance(v, list):
            todo.extend((x, False) for x in v)
            continue
        if not isinstance(v, dict):
            continue
        ref = v.get("$ref")
        if isinstance(ref, str) and (joined or set(v) - _ANNOTATIONS):
            name = next((ref[len(p) :] for p in _DEFINITIONS if ref.startswith(p)), None)
            if name is None or "/" in name:
                return None
            out.add(name.replace("~1", "/").replace("~0", "~"))
        for k, x in v.items():
            if k in ("const", "enum", "default", "examples"):
                continue
            if isinstance(x, list) and (k == "allOf" or (k in ("anyOf", "oneOf") and ("properties" in v or joined))):
                todo.extend((m, True) for m in x)
            else:
                todo.append((x, False))
    return out


def _closed(schema: Any, close: bool, combined: set[str]) -> Any:
    if not isinstance(schema, dict):
        return schema
    schema = _flattened(schema)
    out = dict(schema)
    for k, v in schema.items():
        if k in _FROZEN or (k == "contains" and "maxContains" in schema):
            continue  # as written
        if k in ("$defs", "definitions") and isinstance(v, dict):
            out[k] = {name: _closed(sub, name not in combined, combined) for name, sub in v.items()}
        elif k in _SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: _closed(sub, True, combined) for name, sub in v.items()}
        elif k in _SCHEMA_ONE or (k == "additionalProperties" and isinstance(v, dict)):
            out[k] = _closed(v, True, combined)
        elif k in _SCHEMA_LISTS and isinstance(v, list):
            # alternatives that stand alone: not beside properties, nor inside a part combined with others
            alone = k == "prefixItems" or ("properties" not in schema and close)
            out[k] = [_closed(sub, alone, combined) for sub in v]
        elif k == "allOf" and isinstance(v, list):
            out[k] = [_closed(sub, False, combined) for sub in v]
    others = {"additionalProperties", "patternProperties", "unevaluatedProperties"}
    merged = any(k in schema for k in _MERGED)
    props = out.get("properties")
    if close and not merged and isinstance(props, dict) and not others & set(schema):
        required = schema.get("required")
        extra = [r for r in required if isinstance(r, str) and r not in props] if isinstance(required, list) else []
        out["properties"] = {**props, **dict.fromkeys(extra, {})}
        out["additionalProperties"] = False
    return out


# The compile budget, in llguidance's own units of work (deterministic, unlike a clock): the fuel its lexer may
# burn building a grammar's first regular expressions and per mask. Its defaults: lowering the first (to 300,000)
# refuses JSONSchemaBench schemas llguidance compiles; what makes a small constraint costly, a counted
# repetition, is refused by arithmetic before this (`budget`).
INITIAL_LEXER_FUEL = 1_000_000
STEP_LEXER_FUEL = 200_000


def limits() -> Any:
    from llguidance import LLParserLimits

    return LLParserLimits(initial_lexer_fuel=INITIAL_LEXER_FUEL, step_lexer_fuel=STEP_LEXER_FUEL, verbose_errors=False)


@functools.lru_cache(maxsize=256)
def compiled(spec_text: str, vocab: Vocabulary) -> str:
    """The grammar of a constraint, checked against the vocabulary: a constraint the engine cannot build
    (a bad regex, a schema keyword it does not support, a Lark error) is the user's error, naming it."""
    LLMatcher = grammar_engine().LLMatcher

    check_budget(*parse(spec_text))
    try:
        grammar = grammar_of(spec_text)
    except ValueError as e:
        raise UsageError(f"structured_outputs: {e}") from None
    error = LLMatcher.validate_grammar(grammar, vocab.llg, limits=limits())
    if error and not error.startswith("WARNING"):
        raise UsageError(f"structured_outputs: the grammar engine cannot honour it: {error.strip()[:500]}")
    return grammar


_BUILDING = threading.Lock()


@functools.lru_cache(maxsize=16)
def _start(spec_text: str, vocab: Vocabulary) -> Any:
    """A constraint's matcher at the answer's start, built and tried once (`built`); each row takes a copy."""
    from llguidance import LLMatcher

    matcher = LLMatcher(vocab.llg, compiled(spec_text, vocab), log_level=0, limits=limits())
    probe = matcher.deep_copy()
    _first_steps(probe, vocab)
    error = probe.get_error().strip() if probe.is_error() else ""
    if error and not error.startswith("NoExtension"):  # no token to go on with is `check`'s to name, not a cost
        raise UsageError(f"structured_outputs: the grammar engine cannot build it within its budget ({error[:300]})")
    return matcher


def _first_steps(matcher: Any, vocab: Vocabulary) -> None:
    """The work a row's first tokens make the engine do: its first mask, and the mask after the first token it
    allows (where a counted repetition such as `a{1000000}` builds its lexer, and fails past the budget)."""
    for _ in range(2):
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")[: vocab.size]
        allowed = [i for i in np.flatnonzero(bits)[:64].tolist() if i not in vocab.stop_ids]
        if matcher.is_error() or not allowed:
            return
        matcher.consume_token(allowed[0])


def built(spec_text: str, vocab: Vocabulary) -> Any:
    """A fresh matcher of a constraint at the answer's start. The first call compiles and tries it (`_start`),
    where a request is admitted, off the decoding thread; later calls copy what it built."""
    start = _start(spec_text, vocab)
    with _BUILDING:
        return start.deep_copy()


class Grammar:
    """One row's matcher: the answer's committed prefix consumed, and which tokens may come next."""

    def __init__(self, spec_text: str, vocab: Vocabulary, slot: str | None = None) -> None:
        """The grammar of a constraint (`spec.canonical`), or with `slot` that of one value slot of a template
        (`structured.template`: a Lark grammar, which never ends the answer: no stop token is allowed)."""
        LLMatcher = grammar_engine().LLMatcher

        self.vocab = vocab
        self.ends = slot is None
        if slot is None:
            self.matcher = built(spec_text, vocab)
        else:
            self.matcher = LLMatcher(vocab.llg, str(LLMatcher.grammar_from_lark(slot)), log_level=0, limits=limits())
        if self.matcher.is_error():
            raise UsageError(f"structured_outputs: {self.matcher.get_error()}")

    def allowed(self, device: torch.device) -> torch.Tensor:
        """(rows,) bool: the tokens that may come next; every stop token where the grammar may end the
        answer."""
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), np.uint8), bitorder="little")
        out = torch.zeros(self.vocab.rows, dtype=torch.bool)
        out[: self.vocab.size] = torch.from_numpy(bits[: self.vocab.size].astype(bool))
        stops = torch.tensor(self.vocab.stop_ids, dtype=torch.long)
        out[stops] = self.ends and self.matcher.is_accepting()
        return out.to(device)

    def take(self, token: int) -> bool:
        """Consume `token` if the grammar allows it here (a stop token where it may end); False leaves the
        state unchanged."""
        if token in self.vocab.stop_ids:
            return self.ends and bool(self.matcher.is_accepting())
        return bool(self.matcher.try_consume_tokens([token]) == 1)

    def filler(self) -> int | None:
        """A template slot's one-space token where its value is complete and nothing but blanks may follow
        (the slot's rest is blanks: the grammar leaves no other choice)."""
        blank = self.vocab.blank
        if self.ends or blank is None or not self.matcher.is_accepting():
            return None
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[: self.vocab.size])
        return blank if all(self.vocab.tokens[i].strip(b" ") == b"" for i in allowed) else None

    def accepting(self) -> bool:
        return bool(self.matcher.is_accepting())

    def must_end(self) -> bool:
        """Complete, with nothing but the end of text allowed next."""
        if not self.accepting():
            return False
        allowed = self.allowed(torch.device("cpu"))
        allowed[self.vocab.stop_ids] = False
        return not bool(allowed.any())

    def undo(self) -> None:
        """Take back the last token consumed."""
        self.matcher.rollback(1)

    def forced(self) -> list[int]:
        """The tokens the grammar alone decides from here (the only way on: a key, a quote, a separator)."""
        return list(self.matcher.compute_ff_tokens())

    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None


def check(spec_text: str | None, vocab: Vocabulary) -> None:
    """A constraint the engine cannot build (a bad regex, a schema keyword it lacks: `compiled`), or whose
    answer no token of this vocabulary can begin, is the user's error before anything decodes."""
    if spec_text is not None and not _can_begin(spec_text, vocab):
        raise UsageError(
            "structured_outputs: this model's vocabulary has no token to begin an answer the constraint "
            "allows (no token spells the text it needs first)"
        )


@functools.lru_cache(maxsize=256)
def _can_begin(spec_text: str, vocab: Vocabulary) -> bool:
    """Whether some token begins an answer (once per constraint: the queue checks every request line)."""
    return bool(Grammar(spec_text, vocab).allowed(torch.device("cpu")).any())


def texts(vocab: Vocabulary, ids: Sequence[int]) -> list[str]:
    return [vocab.text(i) for i in ids]
