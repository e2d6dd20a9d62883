"""Text <-> token ids for a model folder: sentencepiece `tokenizer.model`, HF `tokenizer.json`, or Qwen2's
byte-level BPE as `vocab.json` + `merges.txt` (Dream), built with `tokenizers` as `transformers` builds it.

Special ids (mask, eos, end of turn, pad) come from the model's config.json and are checked against the
tokenizer here, so a mismatched pair fails at load time with a clear message instead of producing
garbage. Chat templates from `tokenizer_config.json` are rendered in a sandboxed Jinja environment.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from ..errors import ModelError, UsageError
from .layers import ArchConfig


class _Backend(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def size(self) -> int: ...
    def piece(self, i: int) -> str | None: ...
    def find(self, piece: str) -> int | None: ...
    def ids(self) -> frozenset[int]: ...


# End-of-turn tokens of the chat formats in use, for folders whose config.json does not name one
# (LLaDA-8B-Instruct's config has no eot id; its tokenizer has <|eot_id|>).
END_OF_TURN = ("<|eot_id|>", "<|im_end|>", "<|role_end|>", "<|end|>")
# padding a family trains its answers to end in (DiffuCoder's runs of <|dlm_pad|> after the answer): its own
# code cuts the output at the first one, so it is a stop token
PAD_STOPS = ("<|dlm_pad|>",)
MASKS = ("<|mask|>", "<|MASK|>", "<|mdm_mask|>", "[MASK]")  # for folders whose config.json names no mask id
LETTERS = re.compile(r"[A-Za-z]+")
STARTED = re.compile(r"[▁Ġ][A-Za-z]+")  # a word's first piece, as sentencepiece and byte-level BPE mark it
CONTINUED = re.compile(r"##[A-Za-z]+")  # WordPiece marks the pieces after a word's first instead


class _SentencePiece:
    def __init__(self, path: Path) -> None:
        import sentencepiece as spm

        try:
            self.sp = spm.SentencePieceProcessor(model_file=str(path))
        except (RuntimeError, OSError) as e:
            raise ModelError(f"{path}: not a sentencepiece model ({e})") from None

    def encode(self, text: str) -> list[int]:
        return list(self.sp.encode(text))

    def decode(self, ids: list[int]) -> str:
        return str(self.sp.decode(ids))

    def size(self) -> int:
        return int(self.sp.get_piece_size())

    def piece(self, i: int) -> str | None:
        return str(self.sp.id_to_piece(i)) if 0 <= i < self.size() else None

    def find(self, piece: str) -> int | None:
        i = int(self.sp.piece_to_id(piece))
        return i if self.piece(i) == piece else None

    def ids(self) -> frozenset[int]:
        """Every id with a piece: sentencepiece numbers its pieces 0..size-1 and raises on any other id."""
        return frozenset(range(self.size()))


class _HFTokenizer:
    tok: Any

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as HF

        try:
            self.tok = HF.from_file(str(path))
        except Exception as e:  # the tokenizers library raises a bare Exception on bad files
            raise ModelError(f"{path}: not a tokenizer.json ({e})") from None

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=False))

    def size(self) -> int:
        return int(self.tok.get_vocab_size(with_added_tokens=True))

    def piece(self, i: int) -> str | None:
        return self.tok.id_to_token(i)

    def find(self, piece: str) -> int | None:
        return self.tok.token_to_id(piece)

    def ids(self) -> frozenset[int]:
        """Every id with a token, added tokens included: an id without one decodes to no text at all, and the
        ids need not be contiguous (added tokens may sit at ids of their own)."""
        return frozenset(self.tok.get_vocab(with_added_tokens=True).values())


# Qwen2's pre-tokenizer: contractions, letters with one leading non-letter, single digits, punctuation runs,
# newlines and spaces (transformers' Qwen2 tokenizer conversion uses the same split)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class _Qwen2BPE(_HFTokenizer):
    """Byte-level BPE from vocab.json + merges.txt, with the added tokens of tokenizer_config.json at the
    ids it gives them."""

    def __init__(self, folder: Path, added: dict[str, Any]) -> None:
        from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
        from tokenizers import Tokenizer as HF
        from tokenizers.models import BPE

        try:
            model = BPE.from_file(str(folder / "vocab.json"), str(folder / "merges.txt"))
        except Exception as e:  # the tokenizers library raises a bare Exception on bad files
            raise ModelError(f"{folder}: vocab.json / merges.txt are not a BPE vocabulary ({e})") from None
        tok = HF(model)
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        for key in sorted(added, key=lambda k: int(k)):
            spec = added[key]
            token = AddedToken(
                spec["content"],
                single_word=spec.get("single_word", False),
                lstrip=spec.get("lstrip", False),
                rstrip=spec.get("rstrip", False),
                normalized=spec.get("normalized", not spec.get("special", False)),
                special=spec.get("special", False),
            )
            tok.add_special_tokens([token]) if spec.get("special", False) else tok.add_tokens([token])
            if tok.token_to_id(spec["content"]) != int(key):
                raise ModelError(
                    f"{folder}: tokenizer_config.json gives {spec['content']!r} id {key}, "
                    f"but the vocabulary puts it at {tok.token_to_id(spec['content'])}"
                )
        self.tok = tok


class Tokenizer:
    def __init__(
        self,
        backend: _Backend,
        cfg: ArchConfig,
        chat_template: str | None,
        folder: Path,
        eos_piece: str | None = None,
        mask_piece: str | None = None,
    ) -> None:
        """eos_piece: the tokenizer's own end-of-sequence token (tokenizer_config.json), for a config.json
        that names no eos_token_id (CoDA's). mask_piece: the mask token tokenizer_config.json names, for a
        mask whose piece does not say "mask" (Nemotron's `<SPECIAL_100>`)."""
        self.backend = backend
        self.chat_template = chat_template
        mask_id = cfg.mask_token_id
        mask_free = getattr(cfg, "mask_free", False)  # a family with no mask token (DiffusionGemma's)
        if mask_free:
            mask_id = -1  # no id: nothing to filter out of an answer, nothing to check
        elif mask_id is None:
            mask_id = next((i for i in map(backend.find, MASKS) if i is not None), None)
            if mask_id is None:
                raise ModelError(f"{folder}: config.json has no mask_token_id and the tokenizer no mask token")
        self.mask_id: int = mask_id
        eos_id = cfg.eos_token_id if cfg.eos_token_id is not None else backend.find(eos_piece or "")
        if eos_id is None:
            raise ModelError(f"{folder}: config.json has no eos_token_id and the tokenizer no eos_token")
        self.eos_id: int = eos_id
        self.eot_id = cfg.eot_token_id
        if self.eot_id is None:
            self.eot_id = next((i for i in map(backend.find, END_OF_TURN) if i is not None), None)
        self.pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else self.eos_id
        self.bos_id = cfg.bos_token_id
        pads = [backend.find(p) for p in PAD_STOPS]
        if getattr(cfg, "pad_stops", False):  # a family whose answers end in its pad token (RND1's)
            pads.append(self.pad_id)
        self.stop_ids = frozenset(i for i in (self.eos_id, self.eot_id, *pads) if i is not None)
        size = backend.size()
        if size > cfg.rows:
            raise ModelError(
                f"{folder}: tokenizer has {size} tokens but the model's embedding has {cfg.rows} "
                "rows; the tokenizer does not belong to this model"
            )
        # RND1's mask is the row after the tokenizer's last token: no piece to check it by
        outside = getattr(cfg, "mask_outside_tokenizer", False) and size <= self.mask_id < cfg.rows
        for name, i in (("mask_token_id", self.mask_id), ("eos_token_id", self.eos_id)):
            if i >= size and not (outside and name == "mask_token_id"):
                raise ModelError(
                    f"{folder}: config.json {name}={i} is not in the tokenizer ({size} tokens); "
                    "the tokenizer does not match the config"
                )
        piece = "mask" if mask_free else backend.piece(self.mask_id) or ""
        if "mask" not in piece.lower() and piece != mask_piece and not outside:
            raise ModelError(
                f"{folder}: config.json mask_token_id={self.mask_id} is {piece!r} in the "
                "tokenizer, not a mask token; the tokenizer does not match the config"
            )

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text)

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt's ids (the engine's and the queue's `Preparer`'s); an empty one is the user's error."""
        ids = self.encode(text)
        if not ids:
            raise UsageError("empty prompt")
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode([i for i in ids if i != self.mask_id])

    def continuation(self, prompt: Sequence[int], ids: list[int]) -> str:
        """The text `ids` add after `prompt`, leading space included, as an OpenAI completion gives it, without
        special tokens (as transformers' `skip_special_tokens`). Decoded alone, a first piece loses its
        word-start mark (sentencepiece drops the ▁ that begins a text), so the answer is decoded after its
        prompt and the prompt's own text cut off."""
        plain = [i for i in prompt if i not in self.special_ids]
        answer = [i for i in ids if i not in self.special_ids]
        head = self.decode(plain)
        whole = self.decode([*plain, *answer])
        return whole[len(head) :] if whole.startswith(head) else self.decode(answer)

    @functools.cached_property
    def decodable_ids(self) -> frozenset[int]:
        """The ids a model may produce: those the tokenizer has a token for, and the special ids the decoders
        need whether or not the tokenizer spells them (RND1's mask sits one past its last token). A released
        head is often padded past its tokenizer (LLaDA-8B: 126,464 rows); the rows past it have no text and are
        cut from the logits (`DiffusionLM.limit_head`)."""
        special = {self.mask_id, self.eos_id, self.pad_id, *self.stop_ids}
        return self.backend.ids() | frozenset(i for i in special if i >= 0)

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """The tokens `tokenizer.json` (or `tokenizer_config.json`) marks special: never part of an answer's
        text. A sentencepiece model's control pieces are left out by its own decoder."""
        tok = getattr(self.backend, "tok", None)
        if tok is None:
            return frozenset()
        return frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)

    @functools.cached_property
    def word_pieces(self) -> frozenset[int]:
        """The pieces that continue a word: Latin letters only, without the word-start marker of
        sentencepiece (▁) or byte-level BPE (Ġ), or with WordPiece's continuation mark (##), whichever
        scheme most of the vocabulary follows. Empty when the vocabulary marks neither, so the two cannot be
        told apart. A piece is judged by its form alone: the first word after a newline or an opening quote
        carries no ▁ either, so it counts as continuing too."""
        pieces = [(i, self.backend.piece(i) or "") for i in range(self.backend.size())]
        started = sum(bool(STARTED.fullmatch(p)) for _, p in pieces)
        continued = sum(bool(CONTINUED.fullmatch(p)) for _, p in pieces)
        if continued > started:  # WordPiece: a bare piece starts a word
            return frozenset(i for i, p in pieces if CONTINUED.fullmatch(p))
        if started:  # a stray `##x` in a ▁/Ġ vocabulary does not make it WordPiece
            return frozenset(i for i, p in pieces if LETTERS.fullmatch(p))
        return frozenset()

    def require_word_pieces(self) -> frozenset[int]:
        """word_pieces, or a usage error naming subword_min_p where the vocabulary cannot tell them."""
        if not self.word_pieces:
            raise UsageError(
                "subword_min_p: this model's tokenizer marks no word starts (▁, Ġ) or continuations (##), "
                "so the pieces that continue a word cannot be told apart"
            )
        return self.word_pieces

    def render_chat(self, prompt: str | list[dict[str, Any]], options: dict[str, Any] | None = None) -> str:
        """Apply the chat template; `prompt` is a user message or an OpenAI-style message list. options: the
        template's own switches (`chat_template_kwargs`, such as `enable_thinking`), each one a variable the
        template reads (one it does not read is refused by name: it would change nothing)."""
        if not self.chat_template:
            raise UsageError("--chat: this model has no chat_template in tokenizer_config.json")
        from jinja2 import TemplateError, meta
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        given = dict(options or {})
        if given:
            reads = meta.find_undeclared_variables(env.parse(self.chat_template)) - TEMPLATE_OWN
            for key in sorted(given):
                if key in TEMPLATE_OWN:
                    raise UsageError(f"chat_template_kwargs: {key} is set by Celeris, not by a request")
                if key not in reads:
                    offer = ", ".join(sorted(reads)) or "none"
                    raise UsageError(
                        f"chat_template_kwargs: this model's chat template does not read {key!r} (it reads: {offer})"
                    )
        try:
            return env.from_string(self.chat_template).render(
                **given,
                messages=messages,
                add_generation_prompt=True,
                bos_token=self.backend.piece(self.bos_id or 0) or "",
                eos_token=self.backend.piece(self.eos_id) or "",
            )
        except TemplateError as e:
            raise UsageError(f"chat template failed to render: {e}") from None


TEMPLATE_OWN = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})  # what Celeris passes


def _json_object(path: Path) -> dict[str, Any]:
    """A tokenizer file's JSON object; {} where the folder has no such file."""
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ModelError(f"{path}: expected a JSON object")
    return raw


def chat_template_of(folder: Path, settings: dict[str, Any] | None = None) -> str | None:
    """The folder's chat template: `chat_template.jinja` (where transformers >= 4.50 saves it), else
    tokenizer_config.json's `chat_template` (a string; a list of named templates gives its "default")."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    if settings is None:
        settings = _json_object(folder / "tokenizer_config.json")
    template = settings.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def load_tokenizer(folder: Path, cfg: ArchConfig) -> Tokenizer:
    folder = Path(folder)
    tc = folder / "tokenizer_config.json"
    settings = _json_object(tc)
    special_map = _json_object(folder / "special_tokens_map.json")  # where tokenizer_config.json names none
    template = chat_template_of(folder, settings)
    backend: _Backend
    if (folder / "tokenizer.model").is_file():
        backend = _SentencePiece(folder / "tokenizer.model")
    elif (folder / "tokenizer.json").is_file():
        backend = _HFTokenizer(folder / "tokenizer.json")
    elif (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        added = settings.get("added_tokens_decoder") or {}
        if not isinstance(added, dict):
            raise ModelError(f"{tc}: added_tokens_decoder must be an object")
        backend = _Qwen2BPE(folder, added)
    else:
        raise ModelError(f"{folder} is incomplete: no tokenizer.model, tokenizer.json or vocab.json + merges.txt")

    def piece(key: str) -> str | None:
        for source in (settings, special_map):
            value = source.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                return value
        return None

    return Tokenizer(backend, cfg, template, folder, piece("eos_token"), piece("mask_token"))
