"""Every generation setting, validated once, with no torch.

A setting ("knob") is declared once in `KNOBS`: its type, built-in default and range rule. Knobs are grouped
into parts (`Schedule`, `Sampling`, `Ordering`, `Guidance`, `Parallel`), and each strategy declares the
parts it honours (`STRATEGY_PARTS`); a decoder receives only those parts, so it cannot quietly ignore a
knob. A knob the user sets that the chosen strategy does not honour is an error naming both.

Layers merge in one order: built-in defaults, then the model folder's `generation_config.json`, then the
queue's `batch.yaml` `generation:`, then the request or the command-line flags. Each layer is checked
against what it lands on; only the last layer's keys count as the user's explicit choice. A model folder may
also hold settings per script of the prompt (`by_script`: Han verse and Latin prose want different
decoding); the engine applies the prompt's preset under the user's layers (`GenerationParams.under`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from .errors import UsageError

Remasking = Literal["low_confidence", "random"]
CacheMode = Literal["none", "prefix", "dual"]
Confidence = Literal["prob", "margin", "lead", "entropy"]
DreamAlg = Literal["maskgit_plus", "topk_margin", "entropy", "origin"]
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class Knob:
    kind: type
    default: Any
    rule: Callable[[Any], bool] = lambda v: True
    meaning: str = ""  # what the rule demands, for the error message
    choices: tuple[str, ...] = ()


def _finite(lo: float, hi: float = math.inf, hi_open: bool = False) -> Callable[[Any], bool]:
    return lambda v: math.isfinite(v) and lo <= v and (v < hi if hi_open else v <= hi)


KNOBS: dict[str, Knob] = {
    # schedule
    "gen_length": Knob(int, 64, lambda v: v >= 1, "a positive integer"),
    "block_length": Knob(int, 32, lambda v: v >= 1, "a positive integer"),
    "denoise_steps": Knob(int, 64, lambda v: v >= 1, "a positive integer"),
    # sampling
    "temperature": Knob(float, 0.0, _finite(0.0), "a finite number >= 0"),
    "min_p": Knob(float, 0.0, _finite(0.0, 1.0, hi_open=True), "in [0, 1)"),
    "top_p": Knob(float, 1.0, lambda v: math.isfinite(v) and 0 < v <= 1, "in (0, 1]"),
    "top_k": Knob(int, 0, lambda v: v >= 0, "an integer >= 0 (0 = off)"),
    # ordering
    "remasking": Knob(str, "low_confidence", choices=("low_confidence", "random")),
    "order_temperature": Knob(float, 0.0, _finite(0.0), "a finite number >= 0"),
    # guidance
    "cfg_scale": Knob(float, 0.0, _finite(0.0), "a finite number >= 0"),
    # parallel (fast only)
    "threshold": Knob(float, 0.9, _finite(0.0, 1.0), "between 0 and 1"),
    "cache": Knob(str, "dual", choices=("dual", "prefix", "none")),
    "confidence": Knob(str, "prob", choices=("prob", "margin", "lead", "entropy")),
    "early_exit": Knob(bool, True),
    "suffix_window": Knob(int, 0, lambda v: v >= 0, "an integer >= 0 (0 = the whole canvas)"),
    # shaping (the fast and block decoders): rules on the logits that look at the answer as a whole
    "presence_penalty": Knob(float, 0.0, _finite(0.0), "a finite number >= 0 (0 = off)"),
    "min_tokens": Knob(int, 0, lambda v: v >= 0, "an integer >= 0 (0 = off)"),
    "subword_min_p": Knob(float, 0.0, _finite(0.0, 1.0, hi_open=True), "in [0, 1) (0 = off)"),
    # Dream's own decoding: time schedule and unmasking rule
    "eps": Knob(float, 1e-3, lambda v: math.isfinite(v) and 0 < v < 1, "in (0, 1)"),
    "alg": Knob(str, "maskgit_plus", choices=("maskgit_plus", "topk_margin", "entropy", "origin")),
    "alg_temp": Knob(float, 0.0, _finite(0.0), "a finite number >= 0"),
    # block diffusion (LLaDA2): steps per block
    "block_steps": Knob(int, 32, lambda v: v >= 1, "a positive integer"),
    # per request
    "seed": Knob(int, 0, lambda v: 0 <= v <= MAX_SEED, f"an integer in 0..{MAX_SEED}"),
    "strategy": Knob(str, "fast", choices=("fast", "reference", "dream", "block", "block-fast")),
    "stop": Knob(
        tuple, (), lambda v: len(v) <= 16 and all(isinstance(s, str) and s for s in v), "at most 16 non-empty strings"
    ),
}
ALIASES = {"steps": "denoise_steps"}
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
class Blocks:
    """Block diffusion's schedule: `block_steps` steps for every block, whose tokens commit at
    block_length // block_steps per step (the remainder to the first steps), as LLaDA2 does."""

    gen_length: int
    block_length: int
    block_steps: int

    @property
    def steps(self) -> int:
        return min(self.block_steps, self.gen_length)

    def transfers(self) -> list[int]:
        base, extra = divmod(self.block_length, self.steps)
        return [base + (1 if i < extra else 0) for i in range(self.steps)]


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
}
STRATEGY_PARTS: dict[str, tuple[str, ...]] = {
    "reference": ("schedule", "sampling", "ordering", "guidance"),
    "fast": ("schedule", "sampling", "ordering", "guidance", "parallel", "shaping"),
    "dream": ("timeline", "sampling", "unmasking"),
    "block": ("blocks", "sampling", "commit", "shaping"),
    "block-fast": ("blocks", "sampling", "commit", "shaping"),
}
PER_REQUEST = ("seed", "strategy", "stop")  # honoured by every strategy, outside the decoder


def honoured(strategy: str) -> tuple[str, ...]:
    """The knobs a strategy honours, in declaration order."""
    names = {f.name for p in STRATEGY_PARTS[strategy] for f in fields(PARTS[p])} | set(PER_REQUEST)
    return tuple(k for k in KNOBS if k in names)


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
    seed: int = KNOBS["seed"].default
    strategy: str = KNOBS["strategy"].default
    stop: tuple[str, ...] = KNOBS["stop"].default
    explicit: frozenset[str] = field(default=frozenset(), compare=False, repr=False)  # keys users set

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
        layer = dict(_coerce(k, v) for k, v in values.items())
        explicit = (base.explicit if base is not None else frozenset()) | frozenset(layer)
        merged = replace(base or cls(), **layer, explicit=explicit)
        merged._check(frozenset(layer))
        return merged._settle()

    def with_(self, **changes: Any) -> GenerationParams:
        return GenerationParams.from_mapping(changes, self)

    @classmethod
    def defaults_from(cls, values: Mapping[str, Any]) -> GenerationParams:
        """A model folder's layer of defaults: each value checked, none explicit. Knobs the default strategy
        does not honour are kept for the strategies that do (Dream's `alg` under the fast default)."""
        layer = dict(_coerce(k, v) for k, v in values.items())
        return replace(cls(), **layer)  # settled when a user layer lands on it, for the strategy that runs

    def as_defaults(self) -> GenerationParams:
        """These settings as a layer of defaults (a model folder's): none of them counts as the user's."""
        return replace(self, explicit=frozenset())

    def _check(self, layer: frozenset[str]) -> None:
        if self.strategy not in STRATEGY_PARTS:
            return  # _coerce already rejected it
        ignored = [k for k in sorted(self.explicit) if k not in honoured(self.strategy)]
        if ignored:
            raise UsageError(
                f"{', '.join(ignored)}: not used by the {self.strategy} strategy "
                f"(it honours {', '.join(k for k in honoured(self.strategy) if k not in PER_REQUEST)})"
            )
        if (
            self.alg == "origin"
            and self.alg_temp > 0
            and {"alg", "alg_temp"} & self.explicit
            and self.strategy == "dream"
        ):
            raise UsageError("alg_temp: origin unmasks at random, with no ranking to draw from; set it to 0")
        capped = self.strategy != "dream"  # Dream's schedule may commit nothing on a step; its own code allows it
        if capped and self.denoise_steps > self.gen_length and "denoise_steps" in layer:
            raise UsageError(
                f"denoise_steps {self.denoise_steps} exceeds gen_length {self.gen_length}: a step commits at least "
                "one token, so more steps than tokens cannot run"
            )
        if self.remasking == "random" and self.order_temperature > 0 and "order_temperature" in self.explicit:
            raise UsageError("order_temperature: random remasking already commits in random order; set it to 0")
        if self.subword_min_p > 0 and self.temperature == 0 and "subword_min_p" in self.explicit:
            raise UsageError("subword_min_p: only sampling draws unlikely pieces; at temperature 0 set it to 0")

    def _settle(self) -> GenerationParams:
        """Resolve what lower layers left inconsistent, so the settings say what runs: steps capped at the
        canvas and raised to one per block. (A short last block also caps its own share at its tokens;
        `schedule.steps_per_block` has the exact count.)"""
        fixes: dict[str, Any] = {}
        if self.alg == "origin" and self.alg_temp > 0:
            fixes["alg_temp"] = 0.0
        if self.denoise_steps > self.gen_length and self.strategy != "dream":
            fixes["denoise_steps"] = self.gen_length
        if self.remasking == "random" and self.order_temperature > 0:
            fixes["order_temperature"] = 0.0
        blocks = (
            len(self.schedule.block_spans)
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

    @property
    def steps_per_block(self) -> list[int]:
        """The steps each block is given; one block (the whole canvas) for strategies without blocks. For
        block diffusion, the steps of one block (how many blocks run depends on the prompt's length)."""
        if "block_steps" in honoured(self.strategy):
            return [self.part("blocks").steps]
        if "block_length" in honoured(self.strategy):
            return self.schedule.steps_per_block
        return [self.denoise_steps]

    def under(self, layer: Mapping[str, Any]) -> GenerationParams:
        """`layer` (a script preset) slipped in beneath the user's layers: a knob a user layer set, or that
        the strategy does not honour, keeps its value; the rest take the layer's."""
        keep = self.explicit | frozenset(k for k in layer if k not in honoured(self.strategy))
        changes = {k: v for k, v in (_coerce(k, v) for k, v in layer.items()) if k not in keep}
        return replace(self, **changes)._settle() if changes else self

    def batch_key(self) -> GenerationParams:
        """Requests whose keys are equal can share a batch: everything but the per-row seed."""
        return replace(self, seed=0)

    def report(self) -> dict[str, Any]:
        """The settings that ran: the knobs the strategy honours, with their values."""
        out = {k: getattr(self, k) for k in honoured(self.strategy)}
        out["stop"] = list(self.stop)
        return out


def check_values(values: Mapping[str, Any]) -> None:
    """Each setting on its own (name, type, range), before any model is known: for a config file's layer,
    whose combination with the model's defaults is checked when the model loads."""
    for key, value in values.items():
        _coerce(key, value)


def _coerce(key: str, value: Any) -> tuple[str, Any]:
    """Check one user-given value against its knob; returns the knob's name and the value in its type."""
    name = ALIASES.get(key.replace("-", "_"), key.replace("-", "_"))
    knob = KNOBS.get(name)
    if knob is None:
        import difflib

        near = difflib.get_close_matches(key.replace("-", "_"), [*KNOBS, *ALIASES], n=1)
        raise UsageError(f"unknown generation parameter {key!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    if knob.kind is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:
            raise UsageError(f"{name} must be {knob.meaning}, got an integer of {len(str(value))} digits") from None
    if knob.kind is tuple and isinstance(value, (str, list)):
        value = (value,) if isinstance(value, str) else tuple(value)
    if not isinstance(value, knob.kind) or (isinstance(value, bool) and knob.kind is not bool):
        raise UsageError(f"{name} must be {_TYPE_NAMES[knob.kind]}, got {value!r}")
    if knob.choices and value not in knob.choices:
        raise UsageError(f"{name}: unknown value {value!r} (choose {', '.join(knob.choices)})")
    if not knob.rule(value):
        raise UsageError(f"{name} must be {knob.meaning}, got {value!r}")
    return name, value


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


# generation_config.json as `transformers` writes it: keys that mean something to Celeris
HF_KEYS = {"max_new_tokens": "gen_length"}  # temperature, top_p and top_k have the same names as ours


def model_layer(raw: Mapping[str, Any]) -> tuple[dict[str, Any], frozenset[int], list[str]]:
    """Split a model folder's generation_config.json into Celeris settings, extra stop ids (HF's
    `eos_token_id`, an int or a list) and the keys ignored (bookkeeping such as `_from_model_config`,
    `transformers_version`, or settings Celeris does not have). `do_sample: false` means greedy."""
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
    if raw.get("do_sample") is False:
        settings["temperature"] = 0.0
    eos = raw.get("eos_token_id")
    eos_list = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in eos_list):
        raise UsageError(f"eos_token_id must be a token id or a list of them, got {eos!r}")
    return settings, frozenset(eos_list), ignored
