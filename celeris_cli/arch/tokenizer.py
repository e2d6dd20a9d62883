"""Text <-> token ids for a model folder: sentencepiece `tokenizer.model` or HF `tokenizer.json`.

Special ids (mask, eos, end of turn, pad) come from the model's config.json and are checked against the
tokenizer here, so a mismatched pair fails at load time with a clear message instead of producing
garbage. Chat templates from `tokenizer_config.json` are rendered in a sandboxed Jinja environment.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from ..errors import ModelError, UsageError
from .llada import ModelConfig


class _Backend(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def size(self) -> int: ...
    def piece(self, i: int) -> str | None: ...
    def find(self, piece: str) -> int | None: ...


# End-of-turn tokens of the chat formats in use, for folders whose config.json does not name one
# (LLaDA-8B-Instruct's config has no eot id; its tokenizer has <|eot_id|>).
END_OF_TURN = ("<|eot_id|>", "<|im_end|>", "<|role_end|>", "<|end|>")


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


class _HFTokenizer:
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


class Tokenizer:
    def __init__(self, backend: _Backend, cfg: ModelConfig, chat_template: str | None, folder: Path) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.mask_id = cfg.mask_token_id
        self.eos_id = cfg.eos_token_id
        self.eot_id = cfg.eot_token_id
        if self.eot_id is None:
            self.eot_id = next((i for i in map(backend.find, END_OF_TURN) if i is not None), None)
        self.pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else cfg.eos_token_id
        self.bos_id = cfg.bos_token_id
        self.stop_ids = frozenset(i for i in (self.eos_id, self.eot_id) if i is not None)
        size = backend.size()
        if size > cfg.rows:
            raise ModelError(
                f"{folder}: tokenizer has {size} tokens but the model's embedding has {cfg.rows} "
                "rows; the tokenizer does not belong to this model"
            )
        for name, i in (("mask_token_id", self.mask_id), ("eos_token_id", self.eos_id)):
            if i >= size:
                raise ModelError(
                    f"{folder}: config.json {name}={i} is not in the tokenizer ({size} tokens); "
                    "the tokenizer does not match the config"
                )
        mask_piece = backend.piece(self.mask_id) or ""
        if "mask" not in mask_piece.lower():
            raise ModelError(
                f"{folder}: config.json mask_token_id={self.mask_id} is {mask_piece!r} in the "
                "tokenizer, not a mask token; the tokenizer does not match the config"
            )

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode([i for i in ids if i != self.mask_id])

    def render_chat(self, prompt: str | list[dict[str, Any]]) -> str:
        """Apply the chat template; `prompt` is a user message or an OpenAI-style message list."""
        if not self.chat_template:
            raise UsageError("--chat: this model has no chat_template in tokenizer_config.json")
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        try:
            return env.from_string(self.chat_template).render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self.backend.piece(self.bos_id or 0) or "",
                eos_token=self.backend.piece(self.eos_id) or "",
            )
        except TemplateError as e:
            raise UsageError(f"chat template failed to render: {e}") from None


def load_tokenizer(folder: Path, cfg: ModelConfig) -> Tokenizer:
    folder = Path(folder)
    template = None
    tc = folder / "tokenizer_config.json"
    if tc.is_file():
        try:
            template = json.loads(tc.read_text(encoding="utf-8")).get("chat_template")
        except (json.JSONDecodeError, AttributeError) as e:
            raise ModelError(f"{tc}: not valid JSON ({e})") from None
    backend: _Backend
    if (folder / "tokenizer.model").is_file():
        backend = _SentencePiece(folder / "tokenizer.model")
    elif (folder / "tokenizer.json").is_file():
        backend = _HFTokenizer(folder / "tokenizer.json")
    else:
        raise ModelError(f"{folder} is incomplete: no tokenizer.model or tokenizer.json")
    return Tokenizer(backend, cfg, template if isinstance(template, str) else None, folder)
