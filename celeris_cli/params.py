"""Every generation setting, validated once, with no torch.

A setting ("knob") is declared once in `KNOBS`: its type, built-in default and range rule. Knobs are grouped
into parts (`Schedule`, `Sampling`, `Ordering`, `Guidance`, `Parallel`), and each strategy declares the
parts it honours (`strategy.STRATEGIES`); a decoder receives only those parts, so it cannot quietly ignore a
knob. A knob the user sets that the chosen strategy does not honour is an error naming both.

Layers merge in one order: built-in defaults, then the model folder's `generation_config.json`, then the
queue's `batch.yaml` `generation:`, then the request or the command-line flags. Each layer is checked
against what it lands on; only the last layer's keys count as the user's explicit choice. A model folder may
also hold settings per script of the prompt (`by_script`: Han verse and Latin prose want different
decoding); the engine applies the prompt's preset under the user's layers (`GenerationParams.under`).
"""

from __future__ import annotations

import difflib
import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from .constraints import canonical
from .errors import PromptTooLong, UsageError
from .strategy import STRATEGIES

Remasking = Literal["low_confidence", "random", "sequential"]
CacheMode = Literal["none", "prefix", "dual"]
Confidence = Literal["prob", "margin", "lead", "entropy"]
DreamAlg = Literal["maskgit_plus", "topk_margin", "entropy", "origin"]
DraftPolicy = str  # "auto", "always", "never" or "random:SEED" (`draft_coin`)
MAX_SEED = 2**63 - 1
# The ceiling of every length and count a user gives (tokens, steps, block length, top-k...): above any
# model's context, and checked before anything is sized by the value (a list per block of a 10^9-token
# canvas once grew a server to 22 GB before the context check could refuse it).
MAX_SIZE = 1 << 20
MAX_STOPS = 16
MAX_STOP_CHARS = 1000
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class Knob:
    """One setting: its type, built-in default and range rule, and what it means. The command line's flag
    (`--top-p`), its help, range and choices are made from this declaration (`cli/knobs.py`)."""

    kind: type
    default: Any
    rule: Callable[[Any], bool] = lambda v: True
    meaning: str = ""  # what the rule demands, for the error message
    choices: tuple[str, ...] = ()
    help: str = ""
    short: str = ""  # a one-letter flag beside the long one (-t)
    nullable: bool = False  # null is a value of its own (confidence_threshold: off)
    text: Callable[[str], Any] | None = None  # how a command-line text becomes the value (a file, a list)
    metavar: str = ""
    # how a value given under a key becomes the knob's (key: as the user wrote it, e.g. response_format)
    convert: Callable[[str, Any], Any] | None = None


MAX_CANVAS_FILE = 64 * 2**20  # the largest --initial-canvases file read


def _token_ids(text: str) -> tuple[int, ...]:
    """`1,106,50` -> (1, 106, 50)."""
    try:
        return tuple(int(t) for t in text.replace(" ", "").split(",") if t)
    except ValueError:
        raise ValueError(f"expected token ids separated by commas, got {text!r}") from None


def _canvases_file(path: str) -> tuple[tuple[int, ...], ...]:
    """A JSON file holding a list of canvases, each a list of token ids (the `initial_canvases` request key)."""
    try:
        if os.path.getsize(path) > MAX_CANVAS_FILE:
            raise ValueError(f"{path} is larger than {MAX_CANVAS_FILE // 2**20} MB")
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read {path} ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not JSON ({e})") from None
    if not isinstance(raw, list) or not all(isinstance(c, list) for c in raw):
        raise ValueError(f"{path} must hold a list of canvases, each a list of token ids")
    return tuple(tuple(c) for c in raw)


def _is_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**31


MAX_CANVASES, MAX_CANVAS = 4096, 65536


def _finite(lo: float, hi: float = math.inf, hi_open: bool = False) -> Callable[[Any], bool]:
    return lambda v: math.isfinite(v) and lo <= v and (v < hi if hi_open else v <= hi)


POSITIVE = f"a positive integer, at most {MAX_SIZE}"
COUNT = f"an integer in 0..{MAX_SIZE}"


def draft_coin(policy: str) -> int | None:
    """The coin's seed of a `random:SEED` drafting policy ("random:7" -> 7); None for any other text."""
    head, _, seed = policy.partition(":")
    if head != "random" or not seed.isdigit() or not seed.isascii() or len(seed) > 19 or int(seed) > MAX_SEED:
        return None
    return int(seed)


def _size(lo: int) -> Callable[[Any], bool]:
    return lambda v: lo <= v <= MAX_SIZE


KNOBS: dict[str, Knob] = {
    # schedule
    "gen_length": Knob(int, 64, _size(1), POSITIVE, help="Tokens to generate (the canvas)."),
    "block_length": Knob(
        int, 32, _size(1), POSITIVE, help="Block size: blocks are decoded left to right (at most gen-length)."
    ),
    "denoise_steps": Knob(
        int,
        64,
        _size(1),
        POSITIVE,
        help="Denoising steps in total over the answer, on every model. They are spread over the blocks: equal "
        "shares, the remainder to the first blocks, at least one step per block and at most one per token "
        "(more than gen-length is an error). More steps commit fewer tokens per step: better quality, more time.",
    ),
    # sampling
    "temperature": Knob(
        float,
        0.0,
        _finite(0.0),
        "a finite number >= 0",
        help="0 is greedy; > 0 samples with float64 Gumbel noise.",
        short="-t",
    ),
    "min_p": Knob(
        float,
        0.0,
        _finite(0.0, 1.0, hi_open=True),
        "in [0, 1)",
        help="When sampling, drop tokens less likely than min-p times the top one (0 = off).",
    ),
    "top_p": Knob(
        float,
        1.0,
        lambda v: math.isfinite(v) and 0 < v <= 1,
        "in (0, 1]",
        help="When sampling, keep the likeliest tokens holding this mass.",
    ),
    "top_k": Knob(
        int,
        0,
        _size(0),
        f"{COUNT} (0 = off)",
        help="When sampling, keep the k likeliest tokens (0 = off).",
    ),
    # ordering
    "remasking": Knob(
        str,
        "low_confidence",
        choices=("low_confidence", "random", "sequential"),
        help="Which predictions commit first: the most confident, at random, or the leftmost masked positions in "
        "order (SDAR's sequential; the threshold is off).",
    ),
    "order_temperature": Knob(
        float,
        0.0,
        _finite(0.0),
        "a finite number >= 0",
        help="Gumbel noise on which positions commit first, fading as each block fills (MaskGIT; 0 = off).",
    ),
    # guidance
    "cfg_scale": Knob(
        float,
        0.0,
        _finite(0.0),
        "a finite number >= 0",
        help="Classifier-free guidance against a view with the prompt masked: un + (s+1)(cond - un) (0 = off).",
    ),
    # parallel (fast only)
    "threshold": Knob(
        float,
        0.9,
        _finite(0.0, 1.0),
        "between 0 and 1",
        help="Also commit every masked position at least this confident.",
    ),
    "cache": Knob(str, "dual", choices=("dual", "prefix", "none"), help="KV cache refreshed once per block."),
    "confidence": Knob(str, "prob", choices=("prob", "margin", "lead", "entropy"), help="How confidence is measured."),
    "early_exit": Knob(bool, True, help="Stop a row once its end of text is decoded."),
    "suffix_window": Knob(
        int,
        0,
        _size(0),
        f"{COUNT} (0 = the whole canvas)",
        help="The model sees at most N masked positions past the active block (0 = the whole canvas).",
    ),
    # shaping (the fast and block decoders): rules on the logits that look at the answer as a whole
    "presence_penalty": Knob(
        float,
        0.0,
        _finite(0.0),
        "a finite number >= 0 (0 = off)",
        help="Subtract X from the logit of every token already in the answer.",
    ),
    "min_tokens": Knob(
        int, 0, _size(0), f"{COUNT} (0 = off)", help="No end of text among the answer's first N tokens."
    ),
    "subword_min_p": Knob(
        float,
        0.0,
        _finite(0.0, 1.0, hi_open=True),
        "in [0, 1) (0 = off)",
        help="When sampling, drop a piece that continues a word when less likely than X times the likeliest token.",
    ),
    # Dream's own decoding: time schedule and unmasking rule
    "eps": Knob(float, 1e-3, lambda v: math.isfinite(v) and 0 < v < 1, "in (0, 1)", help="The time schedule's end."),
    "alg": Knob(
        str,
        "maskgit_plus",
        choices=("maskgit_plus", "topk_margin", "entropy", "origin"),
        help="Which positions unmask first.",
    ),
    "alg_temp": Knob(
        float,
        0.0,
        _finite(0.0),
        "a finite number >= 0",
        help="Draw positions from softmax(confidence / X) instead (0 = in order).",
    ),
    # block diffusion (LLaDA2): steps per block
    "block_steps": Knob(
        int,
        32,
        _size(1),
        POSITIVE,
        help="Denoising steps of each block (LLaDA2's `steps`), instead of --denoise-steps in total.",
    ),
    # speculative decoding (Nemotron-Labs-Diffusion's linear_spec_generate): how a draft block is filled
    "draft_threshold": Knob(
        float,
        0.0,
        _finite(0.0, 1.0),
        "between 0 and 1",
        help="nemotron-spec: each draft forward fills every masked position of the block at least this sure, "
        "and always the surest; 0 drafts the whole block in one forward (the family's default).",
    ),
    # self-speculative decoding (`spec`): whether a round drafts
    "drafting": Knob(
        str,
        "auto",
        lambda v: v in ("auto", "always", "never") or draft_coin(v) is not None,
        f"auto, always, never or random:SEED (SEED an integer from 0 to {MAX_SEED})",
        metavar="<auto|always|never|random:SEED>",
        help="spec: whether a round drafts the next tokens by diffusion as it verifies the last draft: auto "
        "(where the engine's calibrated cost of a forward at the width in flight says it pays), always, never "
        "(one token a forward, the AR mode), or random:SEED (at each round by a coin seeded with SEED: the check "
        "that the schedule cannot change an answer). The answer is the same either way; only the forwards differ.",
    ),
    # token editing (LLaDA2.1; the block strategies)
    "edit_threshold": Knob(
        float,
        1.0,
        _finite(0.0, 1.0),
        "between 0 and 1",
        help="Token editing (LLaDA2.1): rewrite a decided answer token of the current block wherever the model "
        "predicts another with more than this probability (1 = off). The block strategies only (block-fast: "
        "without guidance).",
    ),
    "max_post_edit_steps": Knob(
        int,
        0,
        _size(0),
        COUNT,
        help="Token editing: forwards a block may take after its last mask is filled, while they still edit.",
    ),
    # RND1's own decoding (`decode.rnd1`): how a token is chosen and which positions unmask
    "greedy": Knob(
        bool,
        True,
        help="rnd1: take each position's likeliest token; the temperature, top-k and top-p then shape only the "
        "entropy that ranks positions (RND1's greedy). --no-greedy draws the tokens at the temperature.",
    ),
    "eb_gamma": Knob(
        float,
        -1.0,
        lambda v: v == -1.0 or (math.isfinite(v) and v >= 0),
        "a finite number >= 0, or -1 (off)",
        help="rnd1: entropy-bounded unmasking: each step unmasks, most confident first, the longest run whose "
        "entropy sum minus its largest entropy stays within X (-1 = off: the entropy-ranked schedule).",
    ),
    # DiffusionGemma's own decoding (`decode.diffusion_gemma`): uniform noise, entropy-bounded acceptance
    "temperature_final": Knob(
        float,
        0.4,
        _finite(0.0),
        "a finite number >= 0",
        help="diffusion-gemma: the temperature of a canvas's last step (its t_min); --temperature is the first "
        "step's (its t_max), linear between.",
    ),
    "entropy_bound": Knob(
        float,
        0.1,
        lambda v: math.isfinite(v) and v > 0,
        "a finite number > 0",
        help="diffusion-gemma: each step keeps the sampled tokens of the lowest-entropy positions whose entropy sum "
        "minus its largest stays within X, and redraws the others at random.",
    ),
    "stability_threshold": Knob(
        int,
        1,
        lambda v: 0 <= v <= 1024,
        "an integer in 0..1024",
        help="diffusion-gemma: a canvas may stop once its argmax has not changed for N steps (and it is confident).",
    ),
    "confidence_threshold": Knob(
        float,
        0.005,
        lambda v: v is None or (math.isfinite(v) and v > 0),
        "a finite number > 0, or null (off)",
        nullable=True,
        text=lambda t: None if t.lower() in ("null", "none", "off") else float(t),
        help="diffusion-gemma: a stable canvas stops once its mean entropy is below X; null (or off) turns the "
        "adaptive stop off, so every canvas takes all its steps.",
    ),
    "stop_token_ids": Knob(
        tuple,
        (),
        lambda v: len(v) <= 64 and all(_is_id(i) for i in v),
        "at most 64 token ids",
        text=_token_ids,
        metavar="ID,ID",
        help="diffusion-gemma: end the answer at these token ids instead of the model's stop ids.",
    ),
    "noise": Knob(
        str,
        "celeris",
        choices=("celeris", "torch"),
        help="diffusion-gemma: where random draws come from: each request's own stream (celeris), or, to verify "
        "against transformers, torch's CPU generator seeded with the seed, drawn as its generate draws for one "
        "prompt (torch).",
    ),
    "initial_canvases": Knob(
        tuple,
        (),
        lambda v: (
            len(v) <= MAX_CANVASES
            and all(isinstance(c, tuple) and len(c) <= MAX_CANVAS for c in v)
            and all(_is_id(i) for c in v for i in c)
        ),
        f"at most {MAX_CANVASES} lists of at most {MAX_CANVAS} token ids",
        text=_canvases_file,
        metavar="FILE",
        help="diffusion-gemma: the canvases each denoising loop starts from, in order (a JSON list of token-id "
        "lists); a verification tool.",
    ),
    # structured output and log probabilities (the running sets' strategies: `structured.commit`)
    "structured_outputs": Knob(
        str,
        None,
        nullable=True,
        convert=lambda key, value: canonical(key, value),
        metavar="JSON",
        help='Hold the answer to a constraint (vLLM\'s structured_outputs): {"json": SCHEMA}, {"regex": "..."}, '
        '{"choice": [...]}, {"grammar": LARK} or {"json_object": true}; OpenAI\'s response_format is the '
        "same setting. Nothing outside it is ever committed; a grammar that reaches a dead end ends the answer "
        "with finish_reason length and an error.",
    ),
    "structured_layout": Knob(
        str,
        "left-to-right",
        choices=("left-to-right", "template"),
        help="How a constraint is decoded: left-to-right decides the leftmost open position under the grammar "
        "each step, keeping the step's other picks while the grammar accepts them; template lays a fixed-shape "
        "JSON schema's keys and punctuation into the canvas and denoises its values in parallel, each under its "
        "own grammar (slower than left-to-right on the embedded models: docs/benchmarks.md).",
    ),
    "logprobs": Knob(
        bool,
        False,
        help="Report each answer token's log probability under the step that committed it (after a constraint's mask).",
    ),
    "top_logprobs": Knob(
        int,
        0,
        lambda v: 0 <= v <= MAX_TOP_LOGPROBS,
        f"an integer in 0..{MAX_TOP_LOGPROBS}",
        help="With --logprobs: also the N likeliest tokens at each answer position, from the same distribution.",
    ),
    # per request
    "seed": Knob(
        int,
        0,
        lambda v: 0 <= v <= MAX_SEED,
        f"an integer in 0..{MAX_SEED}",
        help="Random seed. Each prompt's answer depends on it alone, not on batch mates.",
    ),
    "strategy": Knob(
        str,
        "fast",
        choices=tuple(STRATEGIES),
        help="fast (cache, threshold, early exit), reference (LLaDA's decoder), dream (Dream's own), rnd1 (RND1's "
        "own), block or "
        "block-fast (block diffusion, LLaDA2; block-fast keeps an exact cache), nemotron (Nemotron-Labs-Diffusion's "
        "diffusion mode), ar (left to right, on a model trained for it too), nemotron-spec (its speculative "
        "decoding: a diffusion draft checked by a causal pass, the ar answer in fewer forwards), diffusion-gemma "
        "(DiffusionGemma's own: random canvases denoised over a causal cache). The model "
        "folder's architecture says which run on it (celeris inspect).",
    ),
    "deterministic": Knob(
        bool,
        True,
        help="Compute each row as it is computed alone (batch-invariant matmuls and attention), so that an "
        "answer does not depend on its batch mates, their number or their padding (on by default: rule 2). Off "
        "runs the plain kernels, 8-15% faster on the default model, whose rounding can change with the batch "
        "(2 of 63 answers in bfloat16). diffusion-gemma has no such kernels yet: off there.",
    ),
    "stop": Knob(
        tuple,
        (),
        lambda v: len(v) <= MAX_STOPS and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in v),
        f"at most {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} characters",
        help="Cut the answer before this string; repeat for several.",
    ),
}
ALIASES = {"steps": "denoise_steps", "response_format": "structured_outputs"}
_TYPE_NAMES = {
    int: "an integer",
    float: "a number",
    str: "a string",
    bool: "true or false",
    tuple: "a string or a list",
}


@dataclass(frozen=True)
class Schedule:
    gen_length: int
    block_length: int
    denoise_steps: int

    @property
    def block_spans(self) -> list[tuple[int, int]]:
        """(start, end) of each block within the generation part; the last block may be shorter."""
        b = min(self.block_length, self.gen_length)
        return [(s, min(s + b, self.gen_length)) for s in range(0, self.gen_length, b)]

    @property
    def steps_per_block(self) -> list[int]:
        """The steps spread over the blocks: equal shares, the remainder to the first blocks, at least one
        per block and at most one per token of the block (a step that can commit nothing is not run)."""
        spans = self.block_spans
        return [min(n, e - s) for n, (s, e) in zip(split_steps(self.denoise_steps, len(spans)), spans)]


def split_steps(steps: int, num_blocks: int) -> list[int]:
    """Equal shares of `steps`, the remainder to the first blocks, and at least one step per block."""
    base, extra = divmod(steps, num_blocks)
    return [max(1, base + (1 if i < extra else 0)) for i in range(num_blocks)]


def spread_steps(steps: int, caps: list[int]) -> list[int]:
    """`steps` over blocks that can take at most caps[i] each (one step per masked position): equal shares,
    the remainder to the first blocks, a full block's surplus shared again among the others; at least one
    step per block."""
    out, left, open_ = [0] * len(caps), steps, list(range(len(caps)))
    while left > 0 and open_:
        shares = split_steps(left, len(open_)) if left >= len(open_) else [1] * left
        for i, share in zip(open_, shares):
            take = min(share, caps[i] - out[i])
            out[i], left = out[i] + take, left - take
        open_ = [i for i in open_ if out[i] < caps[i]]
    return [max(1, n) for n in out]


@dataclass(frozen=True)
class Sampling:
    temperature: float
    min_p: float
    top_p: float
    top_k: int


@dataclass(frozen=True)
class Ordering:
    remasking: Remasking
    order_temperature: float


@dataclass(frozen=True)
class Guidance:
    cfg_scale: float


@dataclass(frozen=True)
class Parallel:
    threshold: float
    cache: CacheMode
    confidence: Confidence
    early_exit: bool
    suffix_window: int  # masked positions past the active block that the model sees; 0 = all


@dataclass(frozen=True)
class Shaping:
    """presence_penalty: subtracted from the logit of every token already committed in the answer (OpenAI's
    presence penalty, over the answer, not the prompt); min_tokens: no stop token among the answer's first
    min_tokens positions (vLLM's min_tokens), so a prompt that ends a sentence still gets an answer;
    subword_min_p: when sampling, a piece that continues a word (the tokenizer marks no word start on it) is
    dropped when less likely than subword_min_p times the likeliest token, a stricter min-p for the pieces
    that glue into invented words (`uncilication`), while the choice of words keeps min_p's spread."""

    presence_penalty: float
    min_tokens: int
    subword_min_p: float

    @property
    def active(self) -> bool:
        return self.presence_penalty > 0 or self.min_tokens > 0 or self.subword_min_p > 0


@dataclass(frozen=True)
class Timeline:
    """Dream's schedule: one canvas, time falling linearly from 1 to eps over the steps."""

    gen_length: int
    denoise_steps: int
    eps: float


@dataclass(frozen=True)
class Unmasking:
    alg: DreamAlg
    alg_temp: float


@dataclass(frozen=True)
class Canvas:
    """One canvas of gen_length positions and its steps: no blocks, no time schedule (RND1)."""

    gen_length: int
    denoise_steps: int


@dataclass(frozen=True)
class Filters:
    """The temperature, top-k and top-p, without min-p (RND1 has none)."""

    temperature: float
    top_p: float
    top_k: int


@dataclass(frozen=True)
class EntropyRanking:
    """RND1's unmasking: greedy tokens or drawn ones; the entropy-ranked schedule, or with eb_gamma >= 0
    the entropy-bounded one."""

    greedy: bool
    eb_gamma: float

    @property
    def bounded(self) -> bool:
        return self.eb_gamma >= 0


@dataclass(frozen=True)
class Blocks:
    """Block diffusion's schedule. The steps are given one of two ways: `block_steps` for every block, whose
    tokens commit at block_length // block_steps per step (the remainder to the first steps), as LLaDA2
    does; or (`steps_total`) `denoise_steps` in total over the answer's blocks, spread as LLaDA's decoder
    spreads them (equal shares, the remainder to the first blocks, at least one step per block) and at most
    one per masked position of a block (`spread_steps`), whose masked positions commit in equal shares per
    step."""

    gen_length: int
    block_length: int
    block_steps: int
    denoise_steps: int
    steps_total: bool

    def masked(self, prompt_tokens: int) -> list[int]:
        """The masked positions of each block a row decodes: its first block may hold the prompt's tail,
        and the last runs to the end of its block (LLaDA2's layout; see `decode.block`)."""
        W = self.block_length
        n = -(-(prompt_tokens + self.gen_length) // W) - prompt_tokens // W
        return [W - prompt_tokens % W] + [W] * (n - 1)

    def steps_for(self, prompt_tokens: int) -> list[int]:
        """The steps scheduled for each block of a row whose prompt has `prompt_tokens` tokens."""
        masked = self.masked(prompt_tokens)
        if not self.steps_total:
            return [min(self.block_steps, self.gen_length)] * len(masked)
        return spread_steps(self.denoise_steps, masked)

    def seeded_steps(self) -> list[int]:
        """Nemotron-Labs-Diffusion's blocks (`decode.nemotron`): block_length each from the answer's start (the
        last may be shorter), each a seed token and block_length - 1 masked positions; block_steps per block,
        or denoise_steps spread over them, capped at the masked positions (a one-token block takes none)."""
        W, G = self.block_length, self.gen_length
        masked = [min(W, G - s) - 1 for s in range(0, G, W)]
        if not self.steps_total:
            return [min(self.block_steps, m) for m in masked]
        return [min(n, m) for n, m in zip(spread_steps(self.denoise_steps, [max(m, 1) for m in masked]), masked)]

    def canvas_steps(self) -> list[int]:
        """DiffusionGemma's canvases (`decode.diffusion_gemma`): the answer in whole canvases of block_length
        (the last whole too, as its generate decodes it), each at most block_steps steps, or denoise_steps
        spread over them."""
        n = -(-self.gen_length // self.block_length)
        return split_steps(self.denoise_steps, n) if self.steps_total else [self.block_steps] * n

    def transfers(self, steps: int, masked: int) -> list[int]:
        """Tokens committed at each of a block's `steps` steps: the block's length in equal shares (LLaDA2),
        or with a total of steps, the block's masked positions."""
        base, extra = divmod(masked if self.steps_total else self.block_length, steps)
        return [base + (1 if i < extra else 0) for i in range(steps)]


@dataclass(frozen=True)
class Editing:
    """LLaDA2.1's token editing: decided tokens rewritten where the model is surer of another."""

    edit_threshold: float
    max_post_edit_steps: int

    @property
    def active(self) -> bool:
        return self.edit_threshold < 1.0


@dataclass(frozen=True)
class Length:
    """The answer's length alone: the AR mode has no blocks and no steps."""

    gen_length: int


@dataclass(frozen=True)
class Draft:
    """Speculative decoding's settings: the answer's length, the draft block and how a draft is filled."""

    gen_length: int
    block_length: int
    draft_threshold: float


@dataclass(frozen=True)
class Drafting:
    """Self-speculative decoding's settings (`decode.selfspec`). A drafting round appends `width` masks, so a
    wholly accepted answer takes about denoise_steps forwards: denoise_steps = gen_length is the AR mode's one
    token a forward, fewer steps draft wider."""

    gen_length: int
    denoise_steps: int
    drafting: DraftPolicy

    @property
    def width(self) -> int:
        return -(-self.gen_length // max(1, min(self.denoise_steps, self.gen_length)))


@dataclass(frozen=True)
class Denoising:
    """DiffusionGemma's steps: the temperature falling linearly from `temperature` (t_max) to
    `temperature_final` (t_min), the entropy bound on what a step keeps, and the adaptive stop (off where
    confidence_threshold is None)."""

    temperature: float
    temperature_final: float
    entropy_bound: float
    stability_threshold: int
    confidence_threshold: float | None


@dataclass(frozen=True)
class CanvasNoise:
    """Where DiffusionGemma's random draws come from, and the canvases its loops start from where pinned."""

    noise: str
    initial_canvases: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class StopIds:
    """Token ids that end an answer in place of the model's (none: the model's)."""

    stop_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Structure:
    """What a row's answer is held to (`structured_outputs`: canonical text, `constraints`; None: nothing)
    and whether its tokens' log probabilities are recorded (with the top_logprobs likeliest at each)."""

    structured_outputs: str | None
    structured_layout: str
    logprobs: bool
    top_logprobs: int

    @property
    def active(self) -> bool:
        return self.structured_outputs is not None or self.logprobs


# a plan's structure where a row's rule comes with the row (`structured.commit`), not with the plan
NO_STRUCTURE = Structure(None, "left-to-right", False, 0)
NO_SHAPING = Shaping(0.0, 0, 0.0)


@dataclass(frozen=True)
class Commit:
    """Block diffusion's threshold: every masked position above it commits, and at least the schedule's."""

    threshold: float


PARTS: dict[str, type] = {
    "schedule": Schedule,
    "sampling": Sampling,
    "ordering": Ordering,
    "guidance": Guidance,
    "parallel": Parallel,
    "shaping": Shaping,
    "timeline": Timeline,
    "unmasking": Unmasking,
    "blocks": Blocks,
    "commit": Commit,
    "length": Length,
    "editing": Editing,
    "canvas": Canvas,
    "filters": Filters,
    "entropy": EntropyRanking,
    "draft": Draft,
    "drafting": Drafting,
    "denoising": Denoising,
    "noise": CanvasNoise,
    "stops": StopIds,
    "structure": Structure,
}
PER_REQUEST = ("seed", "strategy", "deterministic", "stop")  # honoured by every strategy, outside the decoder


def honoured(strategy: str) -> tuple[str, ...]:
    """The knobs a strategy honours, in declaration order."""
    names = {f.name for p in STRATEGIES[strategy].parts for f in fields(PARTS[p])} | set(PER_REQUEST)
    return tuple(k for k in KNOBS if k in names)


# what an answer holds rather than how it is decoded: asked of a model whose default strategy lacks one, with no
# strategy chosen, the model's first strategy that has it runs (`GenerationParams._able`)
FEATURES = frozenset({"structured_outputs", "structured_layout", "logprobs", "top_logprobs"})


@dataclass(frozen=True)
class GenerationParams:
    """Everything that decides an answer, validated however it is built; `from_mapping` layers user input."""

    gen_length: int = KNOBS["gen_length"].default
    block_length: int = KNOBS["block_length"].default
    denoise_steps: int = KNOBS["denoise_steps"].default
    temperature: float = KNOBS["temperature"].default
    min_p: float = KNOBS["min_p"].default
    top_p: float = KNOBS["top_p"].default
    top_k: int = KNOBS["top_k"].default
    remasking: Remasking = KNOBS["remasking"].default
    order_temperature: float = KNOBS["order_temperature"].default
    cfg_scale: float = KNOBS["cfg_scale"].default
    threshold: float = KNOBS["threshold"].default
    cache: CacheMode = KNOBS["cache"].default
    confidence: Confidence = KNOBS["confidence"].default
    early_exit: bool = KNOBS["early_exit"].default
    suffix_window: int = KNOBS["suffix_window"].default
    presence_penalty: float = KNOBS["presence_penalty"].default
    min_tokens: int = KNOBS["min_tokens"].default
    subword_min_p: float = KNOBS["subword_min_p"].default
    eps: float = KNOBS["eps"].default
    alg: DreamAlg = KNOBS["alg"].default
    alg_temp: float = KNOBS["alg_temp"].default
    block_steps: int = KNOBS["block_steps"].default
    draft_threshold: float = KNOBS["draft_threshold"].default
    drafting: DraftPolicy = KNOBS["drafting"].default
    edit_threshold: float = KNOBS["edit_threshold"].default
    max_post_edit_steps: int = KNOBS["max_post_edit_steps"].default
    greedy: bool = KNOBS["greedy"].default
    eb_gamma: float = KNOBS["eb_gamma"].default
    temperature_final: float = KNOBS["temperature_final"].default
    entropy_bound: float = KNOBS["entropy_bound"].default
    stability_threshold: int = KNOBS["stability_threshold"].default
    confidence_threshold: float | None = KNOBS["confidence_threshold"].default
    stop_token_ids: tuple[int, ...] = KNOBS["stop_token_ids"].default
    noise: str = KNOBS["noise"].default
    initial_canvases: tuple[tuple[int, ...], ...] = KNOBS["initial_canvases"].default
    structured_outputs: str | None = KNOBS["structured_outputs"].default
    structured_layout: str = KNOBS["structured_layout"].default
    logprobs: bool = KNOBS["logprobs"].default
    top_logprobs: int = KNOBS["top_logprobs"].default
    seed: int = KNOBS["seed"].default
    strategy: str = KNOBS["strategy"].default
    deterministic: bool = KNOBS["deterministic"].default
    stop: tuple[str, ...] = KNOBS["stop"].default
    # which spelling of the steps block diffusion runs: denoise_steps in total (True) or block_steps per
    # block (False); the last layer that named one of them decides (`steps_unit`)
    steps_total: bool = False
    explicit: frozenset[str] = field(default=frozenset(), compare=False, repr=False)  # keys users set
    # the model's strategies in its order (a model folder's defaults give them): where no user layer chose a
    # strategy and the default cannot honour a feature a user asked for (FEATURES: a constraint, log probabilities on a
    # diffusion default), the first of them that honours every setting asked runs instead (`_able`)
    strategies: tuple[str, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        """Every value is checked however the record is built (constructor, `replace`, `from_mapping`)."""
        for knob in KNOBS:
            _, value = _coerce(knob, getattr(self, knob))
            if value is not getattr(self, knob):
                object.__setattr__(self, knob, value)  # e.g. a list of stop strings made a tuple

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], base: GenerationParams | None = None) -> GenerationParams:
        """`values` (one layer of user input: a config, a request, flags) on top of `base`, validated.
        Unknown keys and wrong types are errors that name the key. Keys set by any user layer stay
        explicit; a model folder's defaults are not (see `as_defaults`)."""
        named = [_canonical(k) for k in values]
        twice = sorted({k for k in named if named.count(k) > 1})
        if twice:
            said = [k for k in values if _canonical(k) == twice[0]]
            raise UsageError(f"{' and '.join(said)}: give one (two spellings of one setting)")
        layer = dict(_coerce(k, v) for k, v in values.items())
        base = base or cls()
        explicit = base.explicit | frozenset(layer)
        total = steps_unit(layer, base.steps_total, _spelled(values))
        merged = replace(base, **layer, explicit=explicit, steps_total=total)._able()
        merged._check(frozenset(layer), _spelled(values))
        return merged._settle()

    def _able(self) -> GenerationParams:
        """These settings under the model's first strategy that honours every setting a user asked for, where
        none chose one and the default does not (see `strategies`); otherwise unchanged, so that `_check`
        names what the strategy cannot honour."""
        lacking = {k for k in self.explicit if k not in honoured(self.strategy)}
        if "strategy" in self.explicit or not lacking or not lacking <= FEATURES:
            return self  # a tuning knob of another strategy is the user's mistake, named by `_check`
        able = next((s for s in self.strategies if all(k in honoured(s) for k in self.explicit)), None)
        return replace(self, strategy=able) if able else self

    def with_(self, **changes: Any) -> GenerationParams:
        return GenerationParams.from_mapping(changes, self)

    @classmethod
    def defaults_from(cls, *layers: Mapping[str, Any]) -> GenerationParams:
        """A model's layers of defaults (its architecture's, then its folder's), each value checked, none
        explicit. Knobs the default strategy does not honour are kept for the strategies that do (Dream's
        `alg` under the fast default)."""
        params = cls()
        for values in layers:
            layer = dict(_coerce(k, v) for k, v in values.items())
            params = replace(params, **layer, steps_total=steps_unit(layer, params.steps_total, _spelled(values)))
        return params  # settled when a user layer lands on it, for the strategy that runs

    def as_defaults(self) -> GenerationParams:
        """These settings as a layer of defaults (a model folder's): none of them counts as the user's."""
        return replace(self, explicit=frozenset())

    def _check(self, layer: frozenset[str], spelled: Mapping[str, str] | None = None) -> None:
        """The combination checks; messages name a setting as this layer spelled it (`--top-p` on the
        command line, `top_p` in a request), lower layers' settings by their own names."""
        spelled = spelled or {}

        def name(k: str) -> str:
            return spelled.get(k, k)

        if self.strategy not in STRATEGIES:
            return  # _coerce already rejected it
        strategy = STRATEGIES[self.strategy]
        ignored = [k for k in sorted(self.explicit) if k not in honoured(self.strategy)]
        if ignored:
            raise UsageError(
                f"{', '.join(name(k) for k in ignored)}: not used by the {self.strategy} strategy "
                f"(it honours {', '.join(k for k in honoured(self.strategy) if k not in PER_REQUEST)})"
            )
        # a strategy of whole canvases (DiffusionGemma's, as its generate) decodes a canvas longer than the answer
        canvases = strategy.steps == "canvases"
        if self.block_length > self.gen_length and "block_length" in layer and not canvases:
            raise UsageError(
                f"{name('block_length')} {self.block_length} exceeds {name('gen_length')} {self.gen_length}: "
                "a block longer than the answer would decode positions past its end; use at most "
                f"{self.gen_length}, or raise gen_length"
            )
        if (
            self.alg == "origin"
            and self.alg_temp > 0
            and {"alg", "alg_temp"} & self.explicit
            and "alg_temp" in honoured(self.strategy)
        ):
            raise UsageError("alg_temp: origin unmasks at random, with no ranking to draw from; set it to 0")
        if not strategy.uncapped and self.denoise_steps > self.gen_length and "denoise_steps" in layer:
            raise UsageError(
                f"{name('denoise_steps')} {self.denoise_steps} exceeds {name('gen_length')} {self.gen_length}: a step "
                "commits at least one token, so more steps than tokens cannot run"
            )
        if strategy.end_slot and self.gen_length < 2:
            raise UsageError(
                f"{name('gen_length')} {self.gen_length}: the {self.strategy} strategy keeps the canvas's last "
                "position for the end of text (as its family's own sampler), so it needs at least 2"
            )
        if self.remasking != "low_confidence" and self.order_temperature > 0 and "order_temperature" in self.explicit:
            raise UsageError(
                f"{name('order_temperature')}: {self.remasking} remasking commits in an order of its own, not by "
                "confidence; set it to 0"
            )
        if self.remasking == "sequential" and self.threshold < 1 and "threshold" in self.explicit:
            raise UsageError(
                f"{name('threshold')}: sequential remasking commits the leftmost masked positions in order, not "
                "the confident ones; set it to 1"
            )
        if strategy.running == "block" and self.cfg_scale > 0 and self.part("editing").active:
            raise UsageError(
                f"{name('edit_threshold')} with {name('cfg_scale')}: the block-fast strategy does not edit tokens "
                "under guidance (its running set's edits read the conditional view only); use the block strategy "
                "for both"
            )
        if canvases:
            self._check_canvases(name)
        if self.structured_layout == "template" and self.structured_outputs is None and "structured_layout" in layer:
            raise UsageError(f"{name('structured_layout')}: needs a constraint (structured_outputs or response_format)")
        if (
            self.structured_layout == "template"
            and strategy.left_to_right
            and self.explicit
            & {
                "structured_layout",
                "strategy",
            }
        ):
            raise UsageError(
                f"{name('structured_layout')} template: the {self.strategy} strategy decides an answer left to right "
                "(its AR mode's order), with no masked slots for a template to hold open; use left-to-right"
            )
        if self.top_logprobs > 0 and not self.logprobs and "top_logprobs" in layer:
            raise UsageError(f"{name('top_logprobs')}: needs {name('logprobs')} on")
        editing = self.part("editing").active
        if self.structured_outputs is not None and editing and {"structured_outputs", "edit_threshold"} & layer:
            raise UsageError(
                f"{name('structured_outputs')} with {name('edit_threshold')}: token editing rewrites decided tokens, "
                "which the grammar has already accepted; set edit_threshold to 1"
            )
        if self.logprobs and editing and {"logprobs", "edit_threshold"} & layer:
            raise UsageError(
                f"{name('logprobs')} with {name('edit_threshold')}: token editing replaces a token after the step "
                "that committed it, whose log probability no longer belongs to the answer; set edit_threshold to 1"
            )
        if (
            self.structured_outputs is not None
            and self.stop_token_ids
            and {"stop_token_ids", "structured_outputs"} & layer
        ):
            raise UsageError(
                f"{name('stop_token_ids')} with {name('structured_outputs')}: a constrained answer ends where its "
                "grammar ends, with the model's end of text; a stop token of the request's own could end it before"
            )
        if self.structured_outputs is not None and self.stop and {"stop", "structured_outputs"} & layer:
            raise UsageError(
                f"{name('stop')} with {name('structured_outputs')}: a constrained answer ends where its grammar "
                "ends; a stop string could cut it where the grammar is not complete"
            )
        if self.subword_min_p > 0 and self.temperature == 0 and "subword_min_p" in self.explicit:
            raise UsageError(
                f"{name('subword_min_p')}: only sampling draws unlikely pieces; at temperature 0 set it to 0"
            )

    def _check_canvases(self, name: Callable[[str], str]) -> None:
        """DiffusionGemma's settings together: a temperature that falls or stays (equal first and last: no
        schedule, as its generate with t_max and t_min unset; at 0 nothing can be sampled), pinned canvases of
        the canvas's length, no more than the answer has."""
        if self.temperature < self.temperature_final or self.temperature <= 0:
            raise UsageError(
                f"{name('temperature')} {self.temperature} must be above 0 and at least {name('temperature_final')} "
                f"{self.temperature_final}: the temperature falls from the first to the last step, or stays (for "
                "greedy answers use a tiny one, e.g. temperature 1e-5 and temperature_final 0)"
            )
        if self.logprobs and "logprobs" in self.explicit:
            raise UsageError(
                f"{name('logprobs')}: the diffusion-gemma strategy keeps each canvas's argmax after its last step, "
                "which no single step's distribution committed; use another strategy for log probabilities"
            )
        if self.structured_layout == "template" and "structured_layout" in self.explicit:
            raise UsageError(
                f"{name('structured_layout')} template: the diffusion-gemma strategy has no mask token to hold a "
                "template's slots open; use left-to-right"
            )
        canvases = -(-self.gen_length // self.block_length)
        if len(self.initial_canvases) > canvases:
            raise UsageError(
                f"{name('initial_canvases')}: {len(self.initial_canvases)} canvases given, but an answer of "
                f"{self.gen_length} tokens in canvases of {self.block_length} has {canvases}"
            )
        wrong = [i for i, c in enumerate(self.initial_canvases) if len(c) != self.block_length]
        if wrong:
            raise UsageError(
                f"{name('initial_canvases')}: canvas {wrong[0]} has {len(self.initial_canvases[wrong[0]])} tokens; "
                f"each must have block_length {self.block_length}"
            )

    def _settle(self) -> GenerationParams:
        """Resolve what lower layers left inconsistent, so the settings say what runs: steps capped at the
        canvas and raised to one per block. (A short last block also caps its own share at its tokens;
        `schedule.steps_per_block` has the exact count.)"""
        fixes: dict[str, Any] = {}
        if self.alg == "origin" and self.alg_temp > 0:
            fixes["alg_temp"] = 0.0
        if self.denoise_steps > self.gen_length and not STRATEGIES[self.strategy].uncapped:
            fixes["denoise_steps"] = self.gen_length
        if self.remasking != "low_confidence" and self.order_temperature > 0:
            fixes["order_temperature"] = 0.0
        if self.remasking == "sequential" and self.threshold < 1:
            fixes["threshold"] = 1.0
        if (
            self.deterministic
            and "deterministic" not in self.explicit
            and STRATEGIES[self.strategy].decoder == "diffusion-gemma"
        ):
            fixes["deterministic"] = False  # its invariant kernels cost its speed: asked for, not by default
        blocks = (
            -(-self.gen_length // min(self.block_length, self.gen_length))  # len(block_spans), not built
            if "denoise_steps" in honoured(self.strategy) and "block_length" in honoured(self.strategy)
            else 1
        )
        if self.denoise_steps < blocks:
            fixes["denoise_steps"] = blocks
        return replace(self, **fixes) if fixes else self

    # -- parts, as the decoders receive them ---------------------------------------------------------
    def part(self, name: str) -> Any:
        cls = PARTS[name]
        return cls(**{f.name: getattr(self, f.name) for f in fields(cls)})

    @property
    def schedule(self) -> Schedule:  # the engine reports it; decoders get their parts from strategies._plan
        return self.part("schedule")

    def steps_for(self, prompt_tokens: int) -> list[int]:
        """The steps each block is given for a prompt of `prompt_tokens` tokens; one block (the whole canvas)
        for strategies without blocks. Block diffusion's blocks start at the row's own position 0, so how
        many it decodes depends on the prompt's length."""
        rule = STRATEGIES[self.strategy].steps
        if rule == "seeded":  # its blocks start at the answer, after a seed token each
            return self.part("blocks").seeded_steps()
        if rule == "canvases":  # whole canvases, each with its cap of steps
            return self.part("blocks").canvas_steps()
        if rule == "per_token":  # one token per forward (speculation: at most that)
            return [self.gen_length]
        if rule == "block_steps":
            return self.part("blocks").steps_for(prompt_tokens)
        if rule == "schedule":
            return self.schedule.steps_per_block
        return [self.denoise_steps]

    @property
    def steps_per_block(self) -> list[int]:
        """The steps of each block for a prompt of whole blocks (see `steps_for`)."""
        return self.steps_for(0)

    def under(self, layer: Mapping[str, Any]) -> GenerationParams:
        """`layer` (a script preset) slipped in beneath the user's layers: a knob a user layer set, or that
        the strategy does not honour, keeps its value; the rest take the layer's."""
        keep = self.explicit | frozenset(k for k in layer if k not in honoured(self.strategy))
        changes = {k: v for k, v in (_coerce(k, v) for k, v in layer.items()) if k not in keep}
        user_steps = {"denoise_steps", "block_steps"} & self.explicit  # the user's spelling of the steps stands
        total = self.steps_total if user_steps else steps_unit(changes, self.steps_total)
        return replace(self, **changes, steps_total=total)._settle() if changes else self

    def batch_key(self) -> GenerationParams:
        """Requests whose keys are equal can share a batch: everything but the per-row seed."""
        return replace(self, seed=0)

    def report(self) -> dict[str, Any]:
        """The settings that ran: the knobs the strategy honours, with their values."""
        out = {k: getattr(self, k) for k in honoured(self.strategy)}
        if "block_steps" in out:  # block diffusion runs one spelling of its steps
            del out["block_steps" if self.steps_total else "denoise_steps"]
        out["stop"] = list(self.stop)
        return out


def steps_unit(layer: Mapping[str, Any], below: bool, spelled: Mapping[str, str] | None = None) -> bool:
    """Whether block diffusion counts the steps in total after `layer` lands on settings where it did
    (`below`): a layer naming denoise_steps chooses the total, block_steps the steps per block, neither
    keeps what was below. Naming both in one layer is an error: they are two spellings of one setting."""
    if "denoise_steps" in layer and "block_steps" in layer:
        said = spelled or {}
        raise UsageError(
            f"{said.get('denoise_steps', 'denoise_steps')} and {said.get('block_steps', 'block_steps')}: give one (the "
            "steps in total over the answer, or the steps of each block)"
        )
    return True if "denoise_steps" in layer else False if "block_steps" in layer else below


def _spelled(values: Mapping[str, Any]) -> dict[str, str]:
    """Each knob of a layer by the key the user wrote for it (`--top-p`, `steps`)."""
    return {_canonical(k): k for k in values}


def _canonical(key: str) -> str:
    name = key.lstrip("-").replace("-", "_")
    return ALIASES.get(name, name)


def parse_text(key: str, value: Any) -> Any:
    """A command-line value (text, or a list of texts for `stop`, a bool for a flag) in its knob's type;
    its range is checked where every layer's is (`from_mapping`)."""
    knob = KNOBS.get(_canonical(key))
    if knob is not None and knob.text is not None and isinstance(value, str):
        try:
            return knob.text(value)
        except ValueError as e:
            raise UsageError(f"{key}: {e}") from None
    kind = knob.kind if knob is not None else str
    if not isinstance(value, str) or kind is str:
        return value
    try:
        return kind(value) if kind in (int, float) else value
    except ValueError:
        raise UsageError(f"{key} must be {_TYPE_NAMES[kind]}, got {value!r}") from None


def check_values(values: Mapping[str, Any]) -> None:
    """Each setting on its own (name, type, range), before any model is known: for a config file's layer,
    whose combination with the model's defaults is checked when the model loads."""
    for key, value in values.items():
        _coerce(key, value)


def _coerce(key: str, value: Any) -> tuple[str, Any]:
    """Check one user-given value against its knob; returns the knob's name and the value in its type.
    Messages name the setting as the user wrote it (`--top-p` on the command line, `top_p` in a request)."""
    name = _canonical(key)
    knob = KNOBS.get(name)
    if knob is None:
        near = difflib.get_close_matches(name, [*KNOBS, *ALIASES], n=1)
        raise UsageError(f"unknown generation parameter {key!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    if knob.convert is not None:
        value = knob.convert(key.lstrip("-").replace("-", "_"), value)
    if value is None and knob.nullable:
        return name, None
    if knob.kind is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:
            raise UsageError(f"{key} must be {knob.meaning}, got {_shown(value)}") from None
    if knob.kind is tuple and isinstance(value, int) and not isinstance(value, bool):
        value = (value,)  # one token id (stop_token_ids: 1, as transformers' eos_token_id may be)
    if knob.kind is tuple and isinstance(value, (str, list)):
        value = (value,) if isinstance(value, str) else tuple(tuple(v) if isinstance(v, list) else v for v in value)
    if not isinstance(value, knob.kind) or (isinstance(value, bool) and knob.kind is not bool):
        raise UsageError(f"{key} must be {_TYPE_NAMES[knob.kind]}, got {_shown(value)}")
    if knob.choices and value not in knob.choices:
        raise UsageError(f"{key}: unknown value {_shown(value)} (choose {', '.join(knob.choices)})")
    if not knob.rule(value):
        raise UsageError(f"{key} must be {knob.meaning}, got {_shown(value)}")
    return name, value


def _shown(value: Any) -> str:
    """A value for an error message, cut short: a 5,000-digit integer or a long list is not echoed whole
    (and repr of an integer past Python's digit limit would itself raise)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**30:
        return f"an integer of about {int(value.bit_length() * 0.30103)} digits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# Settings per script of the prompt, in a model folder's generation_config.json under this key. A preset
# may not change the canvas, the strategy or the request's own knobs: rows of any script can share a batch.
BY_SCRIPT = "by_script"
SCRIPTS = ("han", "latin")
NOT_PER_SCRIPT = ("gen_length", *PER_REQUEST)


def script_of(text: str) -> str | None:
    """The prompt's script: the one of its letters' majority, Han characters against Latin letters."""
    han = sum(1 for c in text if "\u3400" <= c <= "\u9fff" or "\U00020000" <= c <= "\U0002ffff")
    latin = sum(1 for c in text if c.isascii() and c.isalpha())
    return None if han == latin == 0 else "han" if han >= latin else "latin"


def script_layers(raw: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The `by_script` presets of a generation_config.json, each knob checked on its own."""
    presets = raw.get(BY_SCRIPT)
    if presets is None:
        return {}
    if not isinstance(presets, Mapping):
        raise UsageError(f"{BY_SCRIPT} must map a script ({', '.join(SCRIPTS)}) to settings")
    out: dict[str, dict[str, Any]] = {}
    for script, layer in presets.items():
        if script not in SCRIPTS:
            raise UsageError(f"{BY_SCRIPT}: unknown script {script!r} (choose {', '.join(SCRIPTS)})")
        if not isinstance(layer, Mapping):
            raise UsageError(f"{BY_SCRIPT}.{script} must be an object of settings")
        checked = dict(_coerce(k, v) for k, v in layer.items())
        fixed = [k for k in checked if k in NOT_PER_SCRIPT]
        if fixed:
            raise UsageError(f"{BY_SCRIPT}.{script}: {', '.join(fixed)} cannot differ by script")
        out[script] = checked
    return out


# generation_config.json as `transformers` writes it: keys that mean something to Celeris (temperature, top_p,
# top_k and threshold have the same names as ours); LLaDA2.1's token editing under the names its own
# `generate` takes (its model card: editing_threshold, max_post_steps); RND1's steps (its
# RND1GenerationConfig; its greedy and eb_gamma have our names)
HF_KEYS = {
    "max_new_tokens": "gen_length",
    "editing_threshold": "edit_threshold",
    "max_post_steps": "max_post_edit_steps",
    "num_diffusion_steps": "denoise_steps",
    # DiffusionGemma's DiffusionGemmaGenerationConfig (its entropy bound is sampler_config's, see model_layer)
    "max_denoising_steps": "block_steps",
    "t_max": "temperature",
    "t_min": "temperature_final",
}


def model_layer(raw: Mapping[str, Any]) -> tuple[dict[str, Any], frozenset[int], list[str]]:
    """Split a model folder's generation_config.json into Celeris settings, extra stop ids (HF's
    `eos_token_id`, an int or a list) and the keys ignored (bookkeeping such as `_from_model_config`,
    `transformers_version`, or settings Celeris does not have). `do_sample: false` means greedy, except
    beside RND1's `greedy`, which it only mirrors (there the temperature still shapes the entropy ranking)."""
    settings: dict[str, Any] = {}
    ignored: list[str] = []
    for key, value in raw.items():
        if value is None or key in ("eos_token_id", "do_sample", BY_SCRIPT):  # by_script: see script_layers
            continue  # null is "not set" in transformers' files
        if key in HF_KEYS:
            settings[HF_KEYS[key]] = value
        elif key in KNOBS or key in ALIASES:
            settings[key] = value
        else:
            ignored.append(key)
    sampler = raw.get("sampler_config")
    if isinstance(sampler, Mapping) and "entropy_bound" in sampler:  # DiffusionGemma's EntropyBoundSamplerConfig
        settings["entropy_bound"] = sampler["entropy_bound"]
        ignored.remove("sampler_config")
    if raw.get("do_sample") is False and "greedy" not in raw:
        settings["temperature"] = 0.0
    eos = raw.get("eos_token_id")
    eos_list = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in eos_list):
        raise UsageError(f"eos_token_id must be a token id or a list of them, got {eos!r}")
    return settings, frozenset(eos_list), ignored


def check_fits(n_prompt: int, gen_length: int, max_length: int) -> None:
    """A prompt of n_prompt tokens and its answer must fit the model's context (the engine's and the
    queue's `Preparer`'s check)."""
    if n_prompt + gen_length > max_length:
        raise PromptTooLong(
            f"prompt of {n_prompt} tokens plus gen-length {gen_length} exceeds the "
            f"model's context of {max_length} tokens"
        )
