"""The commit rule of a row under a constraint, and the log probabilities of committed tokens: the part of
both commit steps (`fast.commit_step`, `block.commit_step`) that a row's request adds.

A decoder's step proposes a token at every masked position of the block and picks the positions to commit
(`chosen`: the schedule's share, the confident ones). For a row under a constraint (`Rule.grammar`):

- its leftmost uncommitted position is always decided, under the grammar's mask: the same draw of the
  row's own stream (`Places`) from the step's logits with every token the grammar forbids at -inf (a
  greedy step takes the likeliest allowed token; where the unconstrained pick is allowed it is the same
  token, since restricting the candidates keeps a draw's order);
- the positions after it commit too, in order, while each one either is one the grammar alone decides
  (its only way on: a JSON key, a quote, a separator, a template slot's blanks after its value;
  `Grammar.forced`, `Grammar.filler`), laid down without the model, or
  is one the step chose whose proposed token extends the prefix the grammar accepts; the first that is
  neither, and every position after it, stay masked for a later step. So a row commits a prefix of its
  answer each step (at least one token), the parallel commits survive where the model's choices are
  valid, and nothing invalid is ever committed.
- A grammar with no token left (a dead end) ends the answer: a stop token is committed where the next
  token would go and `Rule.dead` says why; the engine reports it with finish_reason "length" and the error,
  never as "stop". Where the logit shaping (min_tokens) forbids every token the grammar allows, the
  grammar wins: the position is decided on the unshaped logits under the mask.

Log probabilities (`Rule.record`): each committed token's log probability under the distribution of the
step that committed it: the log-softmax of that step's logits (guidance and shaping applied, the
grammar's mask where there is one; temperature and the sampling filters not applied, as OpenAI and vLLM
report them), with the `top` likeliest tokens of the same distribution.

Everything here is per row: a row's answer and figures never depend on its batch mates (rule 2).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .grammar import Grammar, Vocabulary
from .template import Template

# decides one position as the step would, with its own draw: (logits (1, V), its flat index) -> token (1,)
Chooser = Callable[[torch.Tensor, int], torch.Tensor]


@dataclass
class Record:
    """The log probabilities of a row's committed tokens, by answer position."""

    top: int
    at: dict[int, tuple[int, float, list[tuple[int, float]]]] = field(default_factory=dict)

    def entries(self, vocab: Vocabulary, n: int) -> list[dict[str, Any]]:
        """OpenAI chat's shape for the answer's first n tokens."""

        def one(i: int, lp: float) -> dict[str, Any]:
            return {"token": vocab.text(i), "logprob": lp, "bytes": list(vocab.tokens[i]) if i < vocab.size else []}

        out = []
        for pos in range(n):
            token, lp, top = self.at[pos]
            out.append({**one(token, lp), "top_logprobs": [one(t, v) for t, v in top]})
        return out


@dataclass
class Rule:
    """What one row's request adds to its commit steps: a grammar (or None) and a log-probability record
    (or None). `dead`: why the grammar ended the answer early."""

    grammar: Grammar | None = None
    record: Record | None = None
    template: Template | None = None  # template-pinned: fixed tokens laid down, value slots with their grammars
    dead: str | None = None
    ended: bool = False  # a stop token is committed: every later position takes one too

    def __post_init__(self) -> None:
        if self.template is not None and self.record is not None:  # the fixed tokens: no other choice
            for pos, token in self.template.fixed.items():
                self.record.at[pos] = (token, 0.0, [(token, 0.0)] if self.record.top else [])

    @property
    def constrained(self) -> bool:
        return self.grammar is not None or self.template is not None

    def lay(self, x: torch.Tensor, gen: int) -> None:
        """A template's fixed tokens into a row's canvas `x` whose answer starts at `gen`, and the end of text
        after it to the canvas's end."""
        if self.template is None:
            return
        for pos, token in self.template.fixed.items():
            if gen + pos < len(x):
                x[gen + pos] = token
        x[gen + self.template.length :] = self.template.fixed[self.template.length - 1]

    def unfinished(self) -> str | None:
        """Why a template's answer is not complete (a value slot whose grammar does not accept), if it is not."""
        if self.template is None:
            return None
        for slot in self.template.slots:
            if not slot.grammar.accepting():
                return f"the value at tokens {slot.start}..{slot.end} of the template is not complete"
        return None


Rules = list[Rule | None]


def settle(
    block: torch.Tensor,
    proposal: torch.Tensor,
    chosen: torch.Tensor,
    logits: Any,
    choose_one: Chooser,
    rules: Rules,
    offsets: list[int],
    mask_id: int,
) -> torch.Tensor:
    """The block (b, T) after the step for rows with rules: `proposal` (b, T) holds the step's token at every
    masked position, `chosen` (b, T) the positions its rule commits; `logits` the step's `StepLogits` over
    the masked positions in row order; `choose_one(logits (1, V), flat index)` decides one position as the
    step would, with its own draw. offsets[b]: the answer position of row b's block column 0."""
    masked = block == mask_id
    flat = torch.full(block.shape, -1, dtype=torch.long, device=block.device)
    flat[masked] = torch.arange(int(masked.sum()), device=block.device)
    out = torch.where(chosen, proposal, block)
    for b, rule in enumerate(rules):
        if rule is None:
            continue
        cols = masked[b].nonzero().flatten().tolist()
        if not cols:
            continue
        if not rule.constrained:
            if rule.record is not None:
                for c in cols:
                    if bool(chosen[b, c]):
                        token = int(out[b, c])
                        note(
                            rule.record,
                            logits(slice(int(flat[b, c]), int(flat[b, c]) + 1)).float(),
                            token,
                            offsets[b] + c,
                        )
            continue
        out[b] = block[b]
        if rule.ended:  # its answer is over: the rest of its canvas is its end of text
            out[b, cols] = _eos(rule)
            continue
        if rule.template is None:
            assert rule.grammar is not None
            _walk(b, rule, rule.grammar, cols, None, block, proposal, chosen, flat, logits, choose_one, offsets[b], out)
            continue
        for slot in rule.template.slots:  # every value slot at once, each left to right under its own grammar
            mine = [c for c in cols if slot.start <= offsets[b] + c < slot.end]
            if mine and not rule.ended:
                last = slot.end - 1 - offsets[b]
                _walk(b, rule, slot.grammar, mine, last, block, proposal, chosen, flat, logits, choose_one,
                      offsets[b], out)  # fmt: skip
    return out


def short_error(error: str | None) -> str | None:
    """The grammar engine's error in a line (it may carry a whole parser state)."""
    return None if error is None else error.strip().splitlines()[0][:300]


def _eos(rule: Rule) -> int:
    grammar = rule.grammar or (rule.template.slots[0].grammar if rule.template and rule.template.slots else None)
    assert grammar is not None
    return grammar.vocab.eos_id


def _walk(
    b: int,
    rule: Rule,
    grammar: Grammar,
    cols: list[int],
    last: int | None,
    block: torch.Tensor,
    proposal: torch.Tensor,
    chosen: torch.Tensor,
    flat: torch.Tensor,
    logits: Any,
    choose_one: Chooser,
    offset: int,
    out: torch.Tensor,
) -> None:
    """Row b's commits under one grammar, over its masked columns `cols` in order (see above), written into
    out[b]. `last`: the column of a template slot's last position, where only a token that completes the
    value is taken."""
    vocab = grammar.vocab
    device = block.device
    c0 = cols[0]
    allowed = grammar.allowed(device)
    i0 = int(flat[b, c0])
    token, scores = _decide(grammar, logits, i0, allowed, choose_one, c0 == last)
    if token is None:
        rule.dead = "the grammar allows no token here (a dead end" + (
            f": {short_error(grammar.error())})" if grammar.error() else ")"
        )
        rule.ended = True
        out[b, c0] = vocab.eos_id
        return
    out[b, c0] = token
    if rule.record is not None:
        note(rule.record, scores, token, offset + c0)
    if token in vocab.stop_ids:
        rule.ended = True
        return
    forced: list[int] = []
    for c in cols[1:]:
        if c != c0 + 1:
            break
        filler = grammar.filler() if last is not None else None
        forced = forced or ([filler] if filler is not None else grammar.forced())
        if forced:
            token = forced.pop(0)
        elif bool(chosen[b, c]):
            token = int(proposal[b, c])
        else:
            break
        if rule.record is not None:
            here = grammar.allowed(device)
            if not bool(here[token]):
                break
            scores_c = under_mask(logits, int(flat[b, c]), here)
            assert scores_c is not None
            note(rule.record, scores_c, token, offset + c)
        if not grammar.take(token):
            break
        if c == last and not grammar.accepting():  # a slot's last token must complete its value
            grammar.undo()
            break
        out[b, c] = token
        c0 = c
        if token in vocab.stop_ids:
            rule.ended = True
            break


def _decide(
    grammar: Grammar, logits: Any, i: int, allowed: torch.Tensor, choose_one: Chooser, last: bool
) -> tuple[int | None, torch.Tensor]:
    """The token of flat position i under the grammar's mask (consumed), and the masked logits; at a slot's
    last position a token after which the value is complete (the next likeliest where one is not)."""
    for _ in range(64 if last else 1):
        scores = under_mask(logits, i, allowed)
        if scores is None:
            break
        token = int(choose_one(scores, i))
        grammar.take(token)
        if not last or grammar.accepting():
            return token, scores
        grammar.undo()
        allowed = allowed.clone()
        allowed[token] = False
    return None, torch.empty(0)


def under_mask(logits: Any, i: int, allowed: torch.Tensor) -> torch.Tensor | None:
    """The logits (1, V) of flat position i with the tokens not allowed at -inf; the unshaped logits where
    the shaping forbids every allowed token; None where nothing is allowed at all."""
    if not bool(allowed.any()):
        return None
    sources = [logits] if logits.shape is None else [logits, replace(logits, shape=None)]
    for source in sources:
        row = source(slice(i, i + 1)).float()
        row = row.masked_fill(~allowed[: row.shape[-1]], float("-inf"))
        if bool(torch.isfinite(row).any()):
            return row
    return None


def note(record: Record, scores: torch.Tensor, token: int, pos: int) -> None:
    logp = scores.log_softmax(-1)[0]
    top: list[tuple[int, float]] = []
    if record.top > 0:
        values, ids = logp.topk(min(record.top, logp.shape[0]))
        top = [(int(t), float(v)) for t, v in zip(ids, values) if torch.isfinite(v)]
    record.at[pos] = (token, float(logp[token]), top)
