"""The engine: text in, text and figures out. Loads a model folder once and decodes batches of prompts.

It knows tokenization and batching; it knows nothing about the CLI, files or queues. Decoding itself is
delegated to the pure functions in `decoding` (and `fast`), chosen by name.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import torch

from .arch import capture, invariant
from .arch.budget import MemoryBudget, read_peak, reset_peak
from .arch.capture import Capture
from .arch.checkpoint import load_model
from .arch.folder import CONFIG, GENERATION_CONFIG, ModelFolder
from .arch.layers import Model
from .arch.memory_sizes import human
from .arch.registry import ARCHITECTURES, Architecture
from .arch.tokenizer import Tokenizer
from .backoff import is_out_of_memory, largest_fitting, run_backing_off
from .backoff import too_large as too_large_error
from .decode import waves
from .decode.canvasrun import CanvasScheduler
from .decode.pace import ForwardCost, Learned
from .decode.running import BlockScheduler
from .decode.runset import KindSet, Occupancy, RowRequest, RunningSet
from .decode.sampling import RowNoise, request_seed
from .decode.seededrun import SeededScheduler
from .decode.selfspec import SelfSpecPlan
from .decode.specrun import SpecScheduler
from .decode.strategies import DECODERS, Net, OnBlock, SpecialTokens, get_strategy, plan_for
from .decode.wholerun import WholeScheduler
from .device import resolve_device, resolve_dtype
from .errors import ModelError, TooLarge, UsageError
from .params import GenerationParams, check_fits, model_layer, script_layers, script_of
from .strategy import STRATEGIES, RowKind
from .structured.commit import Record, Rule, Rules
from .structured.grammar import Grammar, vocabulary
from .structured.template import check_structure, template_for
from .structured.valid import violation

log = logging.getLogger(__name__)

DEFAULT_MODEL = "celeris-spec"
Scheduling = Literal["continuous", "static"]


def embedded_models() -> dict[str, Path]:
    """The models shipped inside the package, by name."""
    root = Path(str(resources.files("celeris_cli"))) / "models"
    return {p.name: p for p in sorted(root.iterdir()) if (p / CONFIG).is_file()} if root.is_dir() else {}


def default_model_dir() -> Path:
    """The embedded model shipped inside the package."""
    path = Path(str(resources.files("celeris_cli"))) / "models" / DEFAULT_MODEL
    if not (path / CONFIG).is_file():
        raise ModelError(f"the embedded model is not installed ({path}); pass --model FOLDER")
    return path


def model_dir(model: str | Path | None) -> Path:
    """The folder a --model value names: the default embedded model for None, a folder as given, or the
    name of an embedded model (`celeris-tiny`) where no folder of that name exists here."""
    if model is None or str(model) == "":
        return default_model_dir()
    path = Path(model)
    if not path.exists() and str(model) in embedded_models():
        return embedded_models()[str(model)]
    if not path.exists() and len(path.parts) == 1:  # a bare name: most likely meant as an embedded model
        names = ", ".join(sorted(embedded_models()))
        raise ModelError(f"model {str(model)!r}: no folder of that name here, nor an embedded model ({names})")
    return path


@dataclass(frozen=True)
class Result:
    """One prompt's answer and the figures of the batch it was decoded in."""

    prompt: str
    text: str
    finish_reason: str  # "stop" (EOS / end of turn) or "length"
    prompt_tokens: int
    output_tokens: int
    denoise_steps: int  # steps scheduled (the sum of steps_per_block); threshold decoders may need fewer
    steps_per_block: list[int]
    nfe: int  # forward passes run for the batch, counted at the model boundary (guidance included)
    wall_s: float
    tokens_per_s: float
    batch_size: int
    device: str
    dtype: str
    seed: int = 0
    peak_memory_mb: float = 0.0  # the batch's peak: CUDA's allocator, or the process's resident memory (CPU)
    settings: dict[str, Any] = field(default_factory=dict)
    # with `logprobs`: one entry per output token, OpenAI chat's shape: {"token", "logprob", "bytes",
    # "top_logprobs": [{"token", "logprob", "bytes"}, ...]} (`structured.commit.Record.entries`)
    logprobs: list[dict[str, Any]] | None = None
    # why an answer under a constraint ended unfinished (finish_reason "length"): its grammar's dead end
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Outcome:
    """A row's answer as its request sees it (`Engine.outcome`): what every caller reports."""

    text: str
    output_tokens: int
    finish_reason: str
    logprobs: list[dict[str, Any]] | None = None
    error: str | None = None


class Engine:
    def __init__(
        self,
        model: Model,
        tokenizer: Tokenizer,
        device: torch.device,
        dtype: torch.dtype,
        model_dir: ModelFolder | Path | None = None,
        arch: Architecture | None = None,
    ) -> None:
        """model_dir: the folder the model came from (its generation_config.json gives the defaults); without
        one, the defaults are the built-in ones under `arch`'s (default: LLaDA's)."""
        folder = ModelFolder.open(model_dir) if isinstance(model_dir, Path) else model_dir
        self.model = model
        self.arch = arch or (folder.arch if folder is not None else ARCHITECTURES["llada"])
        self.tokenizer = tokenizer
        self.device = device
        self.dtype = dtype
        self.model_dir = folder.path if folder is not None else None
        self.max_length = model.cfg.max_sequence_length
        self.defaults = folder.defaults() if folder else GenerationParams.defaults_from(self.arch.layer())
        self.by_script = folder.by_script() if folder else {}
        extra_stops = folder.extra_stops if folder else frozenset()
        outside = sorted(i for i in extra_stops if i >= model.cfg.rows)
        if outside:
            raise ModelError(f"{GENERATION_CONFIG}: eos_token_id {outside[0]} is outside the embedding table")
        self.special = SpecialTokens(tokenizer.mask_id, tokenizer.stop_ids | extra_stops, tokenizer.pad_id)
        limit_head = getattr(model, "limit_head", None)  # a fake at the model boundary may have none
        if limit_head is not None:  # no id without text is ever drawn (a head padded past its tokenizer)
            limit_head(tokenizer.decodable_ids | extra_stops)
        self.positions_computed = 0  # positions through the network over every decode (for `bench`)
        self.forwards_run = 0  # forward passes over every decode, each counted once whatever its rows (`bench`)
        self.drafted = self.accepted = 0  # self-speculation's draft tokens verified and confirmed (for `bench`)
        self._forward_cost: ForwardCost | None = None
        self._learned: dict[tuple[Any, ...], Learned] = {}  # self-speculation's drafting yield, kept (`learned`)
        self.last_occupancy: Occupancy | None = None  # the last running set's (for `bench`)
        self.memory = MemoryBudget(model, dtype)  # the planner's view of this model; no budget unless set
        self.capture: Capture | None = None  # the decode step captured (`--cuda-graphs`), or eager

    def capture_steps(self, backend: Any = "inductor", mode: str | None = "reduce-overhead") -> Capture:
        """Run this engine's decode steps captured from now on (`arch.capture`): on CUDA as CUDA graphs (the
        defaults); another dynamo `backend` with no `mode` traces the same calls on any device (for tests)."""
        if self.capture is not None:
            self.capture.remove()
        self.capture = Capture(self.model, backend, mode)
        return self.capture

    def with_defaults(self, settings: dict[str, Any]) -> Engine:
        """Replace this engine's model-folder layer of defaults with `settings`, a generation_config.json's
        content, script presets included (for tests and tools)."""
        layer, _, _ = model_layer(settings)
        self.defaults = GenerationParams.defaults_from(self.arch.layer(), layer)
        self.by_script = script_layers(settings)
        return self

    def params_for(self, prompt: str, params: GenerationParams) -> GenerationParams:
        """The settings a prompt runs with: `params` with the model's preset for the prompt's script (if
        any) beneath the user's layers."""
        preset = self.by_script.get(script_of(prompt) or "")
        return params.under(preset) if preset else params

    def params(self, overrides: dict[str, Any] | None = None) -> GenerationParams:
        """Settings in the documented order: built-in defaults, the model folder's generation_config.json,
        then `overrides` (a config's, a request's or the command line's), validated, for a strategy this
        model's architecture supports."""
        params = GenerationParams.from_mapping(overrides or {}, self.defaults)
        self.arch.check_strategy(params.strategy)
        if params.subword_min_p > 0:
            self.tokenizer.require_word_pieces()
        self.check_structure(params)
        return params

    def check_structure(self, params: GenerationParams) -> None:
        """A constraint the grammar engine cannot build (a bad regex, a schema keyword it lacks) is the
        user's error before anything decodes (`structured.template.check_structure`). Without one, nothing is
        built: the grammar engine (llguidance) is imported where a constraint is first used."""
        if params.structured_outputs is not None:
            check_structure(params, self.vocabulary())

    def vocabulary(self) -> Any:
        """The tokenizer as the grammar engine sees it (`structured.grammar.Vocabulary`), built once."""
        return vocabulary(self.tokenizer, self.model.cfg.rows, self.answer_stops())

    def answer_stops(self) -> frozenset[int]:
        """Every id that ends an answer (`finish`): the stop ids, the model folder's own, and the pad token."""
        return frozenset(self.special.stop_ids | {self.special.pad_id})

    def rule_for(self, params: GenerationParams) -> Rule | None:
        """A fresh rule for one row (`structured.commit`): its grammar at the answer's start and an empty
        log-probability record; None when its request asks for neither."""
        if params.structured_outputs is None and not params.logprobs:
            return None
        record = Record(params.top_logprobs) if params.logprobs else None
        if params.structured_outputs is None:
            return Rule(None, record)
        spec, vocab = params.structured_outputs, self.vocabulary()
        template = template_for(spec, params.structured_layout, vocab, params.gen_length)
        if template is not None:  # its value slots carry their own grammars
            return Rule(None, record, template)
        return Rule(Grammar(spec, vocab), record)

    # -- token level -------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str, chat: bool = False, chat_options: dict[str, Any] | None = None) -> list[int]:
        """chat_options: the chat template's switches (`Tokenizer.render_chat`), with `chat` only."""
        if chat_options and not chat:
            raise UsageError("chat_template_kwargs: only with --chat (a chat template renders the prompt)")
        text = self.tokenizer.render_chat(prompt, chat_options) if chat else prompt
        ids: list[int] = self.tokenizer.encode_prompt(text)
        return ids

    def check_fits(self, n_prompt: int, params: GenerationParams) -> None:
        check_fits(n_prompt, params.gen_length, self.max_length)

    def decode_ids(
        self,
        batch: Sequence[list[int]],
        params: GenerationParams,
        seeds: Sequence[int] | None = None,
        on_block: OnBlock | None = None,
        rules: Rules | None = None,
    ) -> tuple[list[list[int]], int]:
        """Decode one batch of token-id prompts; returns each row's generated ids (uncut) and the NFE. Row
        b draws its randomness from seeds[b] and its own prompt alone (default seed: params.seed). Rows the
        running set can decode go through it, all admitted at once. on_block(row, generated ids so far):
        called as each row's block is committed (strategies that stream blocks only). rules: each row's
        (`rule_for`), to read its log probabilities and dead end from (`outcome`); made here if not given."""
        seeds = seeds if seeds is not None else [params.seed] * len(batch)
        rules = rules if rules is not None else [self.rule_for(params) for _ in batch]
        streams = STRATEGIES[params.strategy].streams_blocks
        if self.continuous(params) and (on_block is None or streams):
            scheduler, net = self._scheduler([params], len(batch), on_block=on_block)
            requests = [
                self._request(i, ids, params, s, rule) for i, (ids, s, rule) in enumerate(zip(batch, seeds, rules))
            ]
            with invariant.enabled(params.deterministic):
                outs: dict[int, list[int]] = {i: out for i, out, _ in scheduler.run(requests)}
            self._account(scheduler, net)
            return [outs[i] for i in range(len(batch))], net.nfe
        decode = get_strategy(params.strategy)
        self.arch.check_strategy(params.strategy)
        P = max(len(ids) for ids in batch)
        pad = self.tokenizer.pad_id
        prompt = torch.tensor([[pad] * (P - len(ids)) + ids for ids in batch], device=self.device)
        prompt_mask = torch.tensor([[False] * (P - len(ids)) + [True] * len(ids) for ids in batch], device=self.device)
        noise = RowNoise([request_seed(s, ids) for s, ids in zip(seeds, batch)], self.device, seeds)
        net = Net(self.model)
        if STRATEGIES[params.strategy].decoder == "self-spec" and params.drafting == "auto":
            net.cost = self.forward_cost()
            net.learned = self.learned(plan_for(params))
        extra: dict[str, Any] = {"rules": rules} if any(r is not None for r in rules) else {}
        with invariant.enabled(params.deterministic):
            if extra:  # only strategies with the `structure` part get here with rules (params refuses others)
                out = decode(net, prompt, prompt_mask, params, self._special(params), noise, on_block, **extra)  # type: ignore[call-arg]
            elif on_block is None:
                out = decode(net, prompt, prompt_mask, params, self._special(params), noise)
            elif streams:
                out = decode(net, prompt, prompt_mask, params, self._special(params), noise, on_block)  # type: ignore[call-arg]
            else:
                raise UsageError(f"the {params.strategy} strategy commits no blocks to report")
        self.positions_computed += net.positions_computed
        self.forwards_run += net.nfe
        self.drafted, self.accepted = self.drafted + net.drafted, self.accepted + net.accepted
        return out[:, P:].tolist(), net.nfe

    def forward_cost(self) -> ForwardCost:
        """The model's forward cost on this engine's device and dtype (`decode.pace.calibrate`), measured on
        first use and kept, on disk too (`decode.pace.cached_calibration`): what self-speculation's per-round
        choice weighs."""
        if self._forward_cost is None:
            from .decode.pace import cached_calibration

            self._forward_cost = cached_calibration(self.model)
        return self._forward_cost

    def learned(self, plan: SelfSpecPlan) -> Learned:
        """What this engine's self-speculative decodes have seen of drafting with this sampler and shaping
        (`decode.pace.Learned`, one per running set lane's settings): kept across decodes, so that only the
        first explores."""
        return self._learned.setdefault((plan.drafting.drafting, plan.sampling, plan.shaping), Learned())

    def _scheduler(
        self,
        params: Sequence[GenerationParams],
        max_batch: int,
        refill: bool = True,
        on_block: OnBlock | None = None,
        before_round: Callable[[], None] | None = None,
    ) -> tuple[RunningSet[Any], Net]:
        """The running set for rows with these settings (one kind: `_running_kind`); `before_round` is
        called as each of its rounds begins."""
        kinds = {_running_kind(p) for p in params}
        assert len(kinds) == 1 and None not in kinds, "one running set decodes rows of one kind"
        special = self._special(max(params, key=lambda p: p.subword_min_p))  # word pieces if any row needs them
        net = Net(self.model)
        kind = kinds.pop()
        assert kind is not None
        make = _ROW_KINDS[kind]
        return make(self, net, special, params, max_batch, refill, on_block, before_round), net

    @staticmethod
    def _request(key: int, ids: list[int], params: GenerationParams, seed: int, rule: Rule | None = None) -> Any:
        """A row for the running set of its kind, with its row seed (`request_seed`) and its rule."""
        kind = _running_kind(params)
        assert kind is not None, "a row the running set cannot decode"
        return RowRequest(key, list(ids), plan_for(params), request_seed(seed, ids), rule, seed)

    def _account(self, scheduler: RunningSet[Any], net: Net) -> None:
        self.positions_computed += net.positions_computed
        self.forwards_run += net.nfe
        self.drafted, self.accepted = self.drafted + net.drafted, self.accepted + net.accepted
        self.last_occupancy = scheduler.occupancy

    def _special(self, params: GenerationParams) -> SpecialTokens:
        """The special tokens, with the word-continuing pieces when subword_min_p needs them (found once,
        on first use: a large vocabulary takes a moment)."""
        if params.subword_min_p == 0:
            return self.special
        return replace(self.special, word_pieces=self.tokenizer.require_word_pieces())

    def finish(
        self, ids: list[int], stop: Sequence[str] = (), prompt: Sequence[int] = (), stop_ids: Sequence[int] = ()
    ) -> tuple[str, int, str]:
        """(text, output tokens, finish reason): the text `ids` continue `prompt` with, cut at the first stop
        token (`stop_ids` where the request names its own, else the model's) or pad token (a family that pads
        after its answer, as CoDA's <|endoftext|>, ends it there), then at the first stop string (which is
        left out of the text, as OpenAI does). Special tokens are never part of the text (`continuation`)."""
        reason = "length"
        stops = (frozenset(stop_ids) or self.special.stop_ids) | {self.special.pad_id}
        for i, t in enumerate(ids):
            if t in stops:
                ids, reason = ids[:i], "stop"
                break
        text = self.tokenizer.continuation(prompt, ids)
        cuts = [text.find(s) for s in stop if s in text]
        if cuts:
            text, reason = text[: min(cuts)], "stop"
            lo, hi = 1, len(ids)  # the fewest tokens whose text holds a stop string (binary search)
            while lo < hi:
                mid = (lo + hi) // 2
                if any(s in self.tokenizer.continuation(prompt, ids[:mid]) for s in stop):
                    hi = mid
                else:
                    lo = mid + 1
            ids = ids[:lo]
        return text, len(ids), reason

    def outcome(
        self, ids: list[int], params: GenerationParams, prompt: Sequence[int], rule: Rule | None = None
    ) -> Outcome:
        """A row's answer from its generated ids (`finish`) and its rule: the log probabilities of its output
        tokens, and under a constraint the error of an answer that ended before its grammar did (finish
        reason "length", never "stop": a dead end commits a stop token to end the row). An answer that fills
        its length exactly where its grammar must end is complete: "stop", no error; an answer that does not
        validate against the user's own constraint (`structured.valid`) is "length" with the reason."""
        text, n_out, reason = self.finish(ids, params.stop, prompt, params.stop_token_ids)
        error = None
        if rule is not None and rule.constrained:
            unfinished = rule.unfinished()
            if rule.dead is not None or unfinished is not None:
                reason, error = "length", f"structured_outputs: {rule.dead or unfinished}"
            elif reason != "stop" and (replayed := self._replayed(params, ids[:n_out])).accepting():
                # the length ran out where the answer's grammar is complete (replayed over the answer's own
                # tokens: the row's grammar may have taken tokens the canvas held past gen_length): valid;
                # "stop" where the grammar allows nothing but the end of text, else "length" (it could go on)
                reason = "stop" if replayed.must_end() else reason
            elif reason != "stop":
                error = (
                    f"structured_outputs: the answer reached its {params.gen_length} tokens before its grammar was "
                    "complete; raise max_tokens"
                )
            if reason == "stop" and params.structured_outputs is not None:
                # the last word is the user's own constraint, checked by code that shares nothing with the
                # grammar (`structured.valid`): an answer that does not hold to it is never "stop"
                wrong = violation(params.structured_outputs, text)
                if wrong is not None:
                    reason, error = "length", f"structured_outputs: {wrong}"
        logprobs = None
        if rule is not None and rule.record is not None:
            logprobs = rule.record.entries(self.vocabulary(), n_out)
        return Outcome(text, n_out, reason, logprobs, error)

    def _replayed(self, params: GenerationParams, ids: Sequence[int]) -> Grammar:
        """A fresh grammar of the request's constraint after `ids` (a left-to-right constraint's answer)."""
        assert params.structured_outputs is not None
        grammar = Grammar(params.structured_outputs, self.vocabulary())
        for t in ids:
            if not grammar.take(t):
                break
        return grammar

    def decode_batch(
        self,
        prompts: Sequence[str],
        encoded: Sequence[list[int]],
        params: GenerationParams,
        seeds: Sequence[int] | None = None,
        presets: bool = True,
    ) -> list[Result]:
        """Decode prompts (already encoded and checked) as one batch; one Result per prompt. Rows whose
        script presets give them different settings are decoded as separate sub-batches. presets=False:
        `params` are final for every row (the queue's rows, whose presets were applied as they were
        prepared, each under its own request's settings)."""
        seeds = list(seeds) if seeds is not None else [params.seed] * len(encoded)
        if not presets:
            return self._decode_group(prompts, encoded, params, seeds)
        groups: dict[GenerationParams, list[int]] = {}
        for i, prompt in enumerate(prompts):
            groups.setdefault(self.params_for(prompt, params), []).append(i)
        results: list[Result | None] = [None] * len(prompts)
        for group, idx in groups.items():
            sub = self._decode_group(
                [prompts[i] for i in idx], [encoded[i] for i in idx], group, [seeds[i] for i in idx]
            )
            for i, r in zip(idx, sub):
                results[i] = r
        return [r for r in results if r is not None]

    def _decode_group(
        self, prompts: Sequence[str], encoded: Sequence[list[int]], params: GenerationParams, seeds: list[int]
    ) -> list[Result]:
        """The rows as one batch, split where the memory budget or an out-of-memory error asks
        (`backoff`); a row too large alone raises TooLarge once the others are decoded."""

        def run(group: list[tuple[str, list[int], int]]) -> list[Result]:
            return self._decode_rows([g[0] for g in group], [g[1] for g in group], [g[2] for g in group], params)

        outcomes = run_backing_off(
            run,
            list(zip(prompts, encoded, seeds)),
            lambda group: self.memory.need([ids for _, ids, _ in group], params),
            self.memory.budget,
            release=self.memory.release,
        )
        failed = [o.error for o in outcomes if o.error is not None]
        if failed:
            raise failed[0]
        return [o.value for o in outcomes if o.value is not None]

    def _decode_rows(
        self, prompts: Sequence[str], encoded: Sequence[list[int]], seeds: list[int], params: GenerationParams
    ) -> list[Result]:
        reset_peak(self.device)
        t0 = time.perf_counter()
        rules = [self.rule_for(params) for _ in encoded]
        outs, nfe = self.decode_ids(encoded, params, seeds, rules=rules)
        wall = time.perf_counter() - t0
        peak = round(read_peak(self.device) / 2**20, 1)
        return [
            self._result(prompt, ids_in, out, params, seed, nfe, wall, len(encoded), peak, rule)
            for prompt, ids_in, out, seed, rule in zip(prompts, encoded, outs, seeds, rules)
        ]

    def _result(
        self,
        prompt: str,
        ids_in: list[int],
        out: list[int],
        params: GenerationParams,
        seed: int,
        nfe: int,
        wall: float,
        batch_size: int,
        peak_memory_mb: float,
        rule: Rule | None = None,
    ) -> Result:
        answer = self.outcome(out, params, ids_in, rule)
        steps = params.steps_for(len(ids_in))
        return Result(
            prompt=prompt,
            text=answer.text,
            finish_reason=answer.finish_reason,
            prompt_tokens=len(ids_in),
            output_tokens=answer.output_tokens,
            denoise_steps=sum(steps),
            steps_per_block=steps,
            nfe=nfe,
            wall_s=round(wall, 4),
            tokens_per_s=round(answer.output_tokens / wall, 2) if wall > 0 else 0.0,
            batch_size=batch_size,
            device=str(self.device),
            dtype=str(self.dtype).replace("torch.", ""),
            seed=seed,
            peak_memory_mb=peak_memory_mb,
            settings={**params.report(), "seed": seed},
            logprobs=answer.logprobs,
            error=answer.error,
        )

    def decode_running(
        self,
        prompts: Sequence[str],
        encoded: Sequence[list[int]],
        params: Sequence[GenerationParams],
        seeds: Sequence[int],
        max_batch: int,
        on_result: Callable[[int, Result], None] | None = None,
        refill: bool = True,
    ) -> list[Result]:
        """Decode rows (each with its final settings: `continuous` must hold for each) through one running set
        of at most `max_batch` rows, of any mix of kinds (`LiveRun`), that admits the next row whenever one
        finishes. A row's answer is the one it gets alone; its `nfe` counts the forwards it took part in, its
        `wall_s` runs from the start to its finish. on_result(i, result) is called as row i finishes. refill
        False: static batches of max_batch rows through the same decoders (for `bench`'s comparison)."""
        assert all(self.continuous(p) for p in params), "a row the running set cannot decode"
        assert len({p.deterministic for p in params}) <= 1, "rows of one running set compute one way"
        results: list[Result | None] = [None] * len(encoded)
        too_large: list[TooLarge] = []
        live = LiveRun(self, max_batch, refill)
        live.extend([(i, Prompt(prompts[i], list(encoded[i]), params[i], seeds[i])) for i in range(len(encoded))])
        for i, r in live.answers():
            if isinstance(r, TooLarge):
                too_large.append(r)
                continue
            results[i] = r
            if on_result is not None:
                on_result(i, r)
        if too_large:  # the others are decoded (and handed to on_result); this row fails alone
            raise too_large[0]
        return [r for r in results if r is not None]

    def over_budget(self, ids: list[int], params: GenerationParams) -> TooLarge | None:
        """The error of a row whose own estimate alone is over the memory budget (`--max-memory`), as the
        static path's `backoff` gives it; None when it fits or there is no budget."""
        budget = self.memory.budget
        if budget is None:
            return None
        needed = self.memory.need([ids], params)
        return too_large_error(needed, f"over the budget of {human(budget)}") if needed > budget else None

    def live(self, max_batch: int) -> LiveRun:
        """A running set of at most `max_batch` rows that takes rows while it runs (`LiveRun`)."""
        return LiveRun(self, max_batch)

    def _running_width(self, encoded: Sequence[list[int]], params: Sequence[GenerationParams], max_batch: int) -> int:
        """At most max_batch rows, and under a memory budget (`--max-memory`) as many as fit (at least one)
        when every row in flight is as long as the longest prompt with the longest answer of its lane: each
        lane (block width, and cache mode for the fast decoder's rows: `_lane_of`) has a cache of its own in
        the running set, so the lanes' working states add up (the weights counted once)."""
        if self.memory.budget is None:
            return max_batch
        budget = self.memory.budget
        lanes: dict[tuple[Any, ...], list[int]] = {}
        for i, p in enumerate(params):
            lanes.setdefault(_lane_of(p), []).append(i)

        def fits(rows: int) -> bool:
            weights, state = 0, 0
            for idx in lanes.values():
                longest = max((encoded[i] for i in idx), key=len)
                worst = max((params[i] for i in idx), key=lambda p: p.gen_length)
                est = self.memory.estimate([longest] * min(rows, len(idx)), worst)
                if est is None:
                    return False
                weights, state = est.weights, state + est.peak - est.weights
            return weights + state <= budget

        return max(1, largest_fitting(max_batch, fits))

    def continuous(self, params: GenerationParams) -> bool:
        """Whether rows with these settings decode through a running set: block diffusion's two decoders
        (`decode.running`), the fast decoder (`decode.waves`), self-speculation (`decode.specrun`) or
        DiffusionGemma's canvases (`decode.canvasrun`), Nemotron's diffusion mode (`decode.seededrun`) or the
        whole-canvas samplers (`decode.wholerun`): its strategy's row kind (docs/scheduling.md). Other
        strategies decode in static batches."""
        return _running_kind(params) is not None

    # -- text level --------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[str],
        params: GenerationParams | None = None,
        batch_size: int = 16,
        chat: bool = False,
        on_batch: Callable[[int], None] | None = None,
        seeds: Sequence[int] | None = None,
        scheduling: Scheduling = "continuous",
    ) -> list[Result]:
        """Generate an answer for each prompt, in order, with the model's defaults unless `params` is
        given. Prompt i draws its randomness from seeds[i] (default: params.seed), so its answer does not
        depend on the other prompts or the batch size.

        `continuous` (where every row's settings allow it, `continuous()`): one running set of batch_size
        rows, each finished row's place taken by the next prompt at once. `static`, or otherwise: batches of
        batch_size prompts of similar length (so one long prompt does not pad a whole batch), each decoded to
        its end before the next starts (`decode_batch`: through a running set of its own where the rows
        allow it). The answers are the same either way."""
        params = params or self.params()
        seeds = list(seeds) if seeds is not None else [params.seed] * len(prompts)
        if len(seeds) != len(prompts):
            raise UsageError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        if batch_size < 1:
            raise UsageError(f"batch-size must be a positive integer, got {batch_size}")
        encoded = [self.encode_prompt(p, chat) for p in prompts]
        for ids in encoded:
            self.check_fits(len(ids), params)
        if scheduling == "continuous":
            final = [self.params_for(p, params) for p in prompts]
            if all(self.continuous(p) for p in final):
                done = (lambda i, r: on_batch(1)) if on_batch is not None else None
                return self.decode_running(prompts, encoded, final, seeds, batch_size, done)
        order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
        results: list[Result | None] = [None] * len(prompts)
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            batch = self.decode_batch(
                [prompts[i] for i in idx], [encoded[i] for i in idx], params, [seeds[i] for i in idx]
            )
            for i, r in zip(idx, batch):
                results[i] = r
            if on_batch is not None:
                on_batch(len(idx))
        return [r for r in results if r is not None]


@dataclass(frozen=True)
class Prompt:
    """One prompt to decode in a running set: its text, its ids, its final settings and its seed."""

    prompt: str
    ids: list[int]
    params: GenerationParams
    seed: int


@dataclass(frozen=True)
class _Pending:
    row: Prompt
    added: float  # perf_counter() when it was added: its answer's wall_s runs from here


class LiveRun:
    """A running set fed while it runs (`decode.runset.KindSet`: rows of every strategy with a running set, each
    kind in a set of its own, all of them advancing round by round): `add` rows between the answers `answers`
    yields (the queue daemon hands it each batch as it is packed, so a file claimed while others decode joins
    their running set as rows leave, whatever its strategy). Each answer is the one its row gets alone; its
    `wall_s` runs from its `add`. `decode_running` is one of these, all rows added at once.

    Its width is the one place the running set's width is decided: at most `max_batch` rows, and under a
    memory budget (`--max-memory`, CUDA's default) as many as the planner expects to fit, set through the
    running set's `resize`. Out of memory, the rows not yet answered go on in a fresh running set: half as
    wide as the rows that were in flight, or, when one row alone was (the only row admitted and not
    waiting), that row is answered with `TooLarge` and the width comes back. Another exception ends the run:
    the rows left are the caller's to decode again. refill False: static batches (`bench`'s comparison)."""

    def __init__(self, engine: Engine, max_batch: int, refill: bool = True) -> None:
        self.engine, self.max_batch, self.refill = engine, max_batch, refill
        self.cap = max_batch  # out of memory, halved (down to 1) until the set runs empty or a row fails alone
        self.width = max_batch  # rows in flight at most: the cap, and under a memory budget what fits
        self.scheduler: RunningSet[Any] | None = None
        self.kinds: set[str] = set()  # the row kinds it has taken (`_running_kind`): a running set each, in one
        self.net: Net | None = None
        self.deterministic: bool | None = None
        self.rows: dict[int, _Pending] = {}  # by key, as added
        self.on_block: OnBlock | None = None  # (key, generated ids so far) as each row's block is committed
        self.before_round: Callable[[], None] | None = None  # called as each round begins (rows may be cancelled)
        self.refused: list[tuple[int, TooLarge]] = []  # rows over the memory budget alone, by key
        self.rules: dict[int, Rule | None] = {}  # by key: each row's rule, fresh each time it is enqueued
        self.added = 0  # rows added in all (an answer's batch_size is the width, or fewer if fewer came)

    def accepts(self, params: GenerationParams) -> bool:
        """Whether a row with these final settings can join: a strategy with a running set
        (`Engine.continuous`) of any kind, computed as the rows already here are (`deterministic`)."""
        kind = _running_kind(params)
        if not self.rows:
            return kind is not None
        return kind is not None and params.deterministic == self.deterministic

    def add(self, key: int, prompt: str, ids: list[int], params: GenerationParams, seed: int) -> None:
        """A row (its final settings, `accepts`) under the caller's `key`, behind those waiting."""
        self.extend([(key, Prompt(prompt, list(ids), params, seed))])

    def extend(self, rows: Sequence[tuple[int, Prompt]]) -> None:
        """Rows under the caller's keys, behind those waiting (among them, the longest answers first)."""
        now = time.perf_counter()
        self.added += len(rows)
        admitted = []
        for key, row in rows:
            assert self.accepts(row.params), "a row this running set cannot decode"
            over = self.engine.over_budget(row.ids, row.params)
            if over is not None:  # never admitted: answered with its TooLarge before the next answer
                self.refused.append((key, over))
                continue
            admitted.append(key)
            if self.scheduler is None or not self.rows:  # a fresh running set (its caches allocated as rows come)
                self.cap = self.max_batch
                self._fresh(row.params)
            self.deterministic = row.params.deterministic
            self.rows[key] = _Pending(row, now)
        if admitted:
            self._resize()
            self._enqueue(admitted)

    def _resize(self) -> None:
        """The width: the cap, and under a memory budget as many rows as fit when each is as large as the
        largest here (`Engine._running_width`); rows in flight past it finish, none joins meanwhile."""
        fits = self.cap
        if self.engine.memory.budget is not None and self.rows:  # else nothing to work out, at every add
            rows = [p.row for p in self.rows.values()]
            fits = self.engine._running_width([r.ids for r in rows], [r.params for r in rows], self.cap)
        self.width = max(1, min(self.cap, fits))
        if self.scheduler is not None:
            self.scheduler.resize(self.width)

    def _fresh(self, params: GenerationParams) -> None:
        """A fresh running set of every kind (`KindSet`): each kind's own set made as its first row is enqueued,
        over one counting net."""
        self.net = net = Net(self.engine.model)
        self.kinds = set()

        def make(kind: str) -> RunningSet[Any]:
            self.kinds.add(kind)
            ps = [p.row.params for p in self.rows.values() if _running_kind(p.row.params) == kind]
            special = self.engine._special(max(ps, key=lambda p: p.subword_min_p))
            streams = any(s.streams_blocks for s in STRATEGIES.values() if s.running == kind)
            on_block = self.on_block if streams else None  # not the fast decoder's, nor the whole canvases'
            return _ROW_KINDS[kind](self.engine, net, special, ps, self.width, True, on_block, None)

        self.scheduler = KindSet(make, _kind_of, self.width, self.engine.device, self.refill, self._round)

    def _round(self) -> None:
        if self.before_round is not None:
            self.before_round()

    def _enqueue(self, keys: Sequence[int]) -> None:
        assert self.scheduler is not None
        requests = []
        for key in keys:
            row = self.rows[key].row
            if row.params.subword_min_p > 0:  # word pieces, once a row needs them
                self.scheduler.use_word_pieces(self.engine._special(row.params).word_pieces)
            self.rules[key] = self.engine.rule_for(row.params)
            requests.append(self.engine._request(key, row.ids, row.params, row.seed, self.rules[key]))
        self.scheduler.add(requests)

    def cancel(self, key: int) -> None:
        """Drop a row whose caller no longer wants it (a client that left); `answers` never yields it. A row
        waiting leaves at once and never decodes; one in flight leaves its running set as the next round
        begins, its slot freed (`RunningSet.drop`). Call it from the thread that runs `answers`: between two
        answers, or from `before_round`, called as each round of the running set begins."""
        self.rules.pop(key, None)
        if self.rows.pop(key, None) is not None and self.scheduler is not None:
            self.scheduler.drop([key])

    @property
    def pending(self) -> int:
        """Rows added and not yet answered."""
        return len(self.rows) + len(self.refused)

    def answers(self) -> Generator[tuple[int, Result | TooLarge], None, None]:
        """(key, result) as each row finishes, until no row is waiting or in flight; rows added meanwhile
        (between two answers) are decoded in the same run. A row out of memory alone, or over the memory
        budget alone (never admitted): (key, TooLarge)."""
        while self.refused:
            yield self.refused.pop(0)
        while self.scheduler is not None and self.rows:
            scheduler, net, deterministic = self.scheduler, self.net, self.deterministic
            assert net is not None and deterministic is not None
            reset_peak(self.engine.device)
            try:
                for key, out, forwards in _running(scheduler.run(), deterministic):
                    if key not in self.rows:  # cancelled in flight (`cancel`): its answer is discarded
                        continue
                    row, t0 = self.rows[key].row, self.rows.pop(key).added
                    peak = round(read_peak(self.engine.device) / 2**20, 1)
                    wall = time.perf_counter() - t0
                    rows = min(self.width, self.added)  # the set's width, or fewer rows if fewer came
                    args = (row.prompt, row.ids, out, row.params, row.seed, forwards, wall, rows, peak)
                    yield key, self.engine._result(*args, self.rules.pop(key, None))
                    while self.refused:  # rows added meanwhile over the budget alone
                        yield self.refused.pop(0)
                if scheduler is self.scheduler:
                    return  # (rows added at its last answer went to a fresh running set: on with that one)
            except Exception as e:
                if not is_out_of_memory(e):
                    self.rows.clear()
                    raise
                self.engine.memory.release()
                waiting = {r.key for r in scheduler.waiting}
                suspects = [k for k in self.rows if k not in waiting]  # in flight, or being admitted
                failed, needed = None, 0
                if len(suspects) == 1:  # out of memory alone: that row fails; the others go on as wide as before
                    failed = suspects[0]
                    row = self.rows.pop(failed).row
                    needed = self.engine.memory.need([row.ids], row.params)
                    self.cap = self.max_batch
                else:
                    narrower = max(1, min(self.width, len(suspects)) // 2)
                    log.info("out of memory with %d rows in flight; going on with %d", len(suspects), narrower)
                    self.cap = narrower
                if self.rows:
                    self._fresh(next(iter(self.rows.values())).row.params)
                    self._resize()
                    self._enqueue(list(self.rows))
                if failed is not None:
                    yield failed, too_large_error(needed, "out of memory alone")
            except BaseException:  # closed: the rows left are never answered here
                self.rows.clear()
                raise
            finally:
                self.engine._account(scheduler, net)


def _lane_of(params: GenerationParams) -> tuple[Any, ...]:
    """The lane a row runs in, each with a cache of its own: its running set's kind, its block width, and
    for the fast decoder's rows their cache mode (`decode.waves`). The whole-canvas rows keep no cache: all
    of them are one working state, whatever their blocks; so are block diffusion's rows that recompute their
    prefix each step (`block`), in one packed forward whatever their widths."""
    kind = _running_kind(params)
    if kind == "whole":
        return (kind,)
    if STRATEGIES[params.strategy].memory == "block":  # no cache (`decode.running.BlockScheduler.recomputing`)
        return kind, "recomputed"
    return kind, params.block_length, params.cache if kind == "waves" else None


# each running-set plan's row kind, from the strategies (`Strategy.running`): what `KindSet` routes a request by
_PLAN_KINDS: dict[type, RowKind] = {
    DECODERS[s.decoder].plan: s.running for s in STRATEGIES.values() if s.running is not None
}


def _kind_of(request: RowRequest[Any]) -> str:
    return _PLAN_KINDS[type(request.plan)]


def _running_kind(params: GenerationParams) -> RowKind | None:
    """Which running set decodes rows with these settings: "block" (`decode.running`), "waves"
    (`decode.waves`), "spec" (`decode.specrun`), "canvas" (`decode.canvasrun`), "seeded" (`decode.seededrun`),
    "whole" (`decode.wholerun`), or None (static batches): its strategy's row kind
    (`strategy.Strategy.running`), whose running set and request `_ROW_KINDS` makes. Under guidance a row's
    unconditional view takes a second slot in block's or waves', a second forward in whole's."""
    return STRATEGIES[params.strategy].running


def _waves(e: Engine, net: Net, t: SpecialTokens, ps: Any, n: int, refill: bool, on_block: Any, hook: Any) -> Any:
    assert on_block is None, "the fast strategy commits no blocks to report"
    return waves.WaveScheduler(net, t.mask_id, t.stop_ids, n, e.device, t.word_pieces, refill=refill, before_round=hook)


def _spec(e: Engine, net: Net, t: SpecialTokens, ps: Any, n: int, refill: bool, on_block: Any, hook: Any) -> Any:
    cost = e.forward_cost() if any(p.drafting == "auto" for p in ps) else None
    tokens = (net, t.mask_id, t.stop_ids, n, e.device, t.word_pieces)
    return SpecScheduler(*tokens, refill, hook, cost=cost, on_block=on_block, learned=e.learned)


def _canvas(e: Engine, net: Net, t: SpecialTokens, ps: Any, n: int, refill: bool, on_block: Any, hook: Any) -> Any:
    return CanvasScheduler(net, t.stop_ids, t.pad_id, n, e.device, refill, on_block, hook)


def _whole(e: Engine, net: Net, t: SpecialTokens, ps: Any, n: int, refill: bool, on_block: Any, hook: Any) -> Any:
    assert on_block is None, "the whole-canvas samplers commit no blocks to report"
    return WholeScheduler(net, t.mask_id, t.pad_id, n, e.device, refill, hook)


def _lanes(scheduler: type[Any]) -> Callable[..., Any]:
    """A running set of lanes by block width (`decode.running.LaneSet`): block diffusion's, or the seeded one."""

    def make(e: Engine, net: Net, t: SpecialTokens, ps: Any, n: int, refill: bool, on_block: Any, hook: Any) -> Any:
        tokens = (net, t.mask_id, t.stop_ids, t.pad_id, n, e.device, t.word_pieces)
        return scheduler(*tokens, refill=refill, on_block=on_block, before_round=hook)

    return make


# each row kind (`strategy.Strategy.running`): how its running set is made
_ROW_KINDS: dict[str, Callable[..., Any]] = {
    "block": _lanes(BlockScheduler),
    "seeded": _lanes(SeededScheduler),
    "waves": _waves,
    "spec": _spec,
    "canvas": _canvas,
    "whole": _whole,
}


def _running(rows: Iterator[tuple[int, list[int], int]], deterministic: bool) -> Iterator[tuple[int, list[int], int]]:
    """The running set's rows as they finish, each forward computed batch-invariantly or not; the mode is
    set around each step of the generator only, so a caller's code between rows runs outside it."""
    while True:
        with invariant.enabled(deterministic):
            row = next(rows, None)
        if row is None:
            return
        yield row


def load_engine(
    model: str | Path | None = None,
    device: str = "auto",
    dtype: str = "auto",
    threads: int | None = None,
    quantize: str = "none",
    max_memory: str | int | None = None,
    cuda_graphs: str = "auto",
) -> Engine:
    """Load a model folder (default: the embedded model) onto a device, ready to generate. `quantize`:
    "int8" or "int4" weights (`arch.quantize`); `max_memory`: the budget batches are sized to
    (`arch.budget`); `cuda_graphs`: auto, on or off, each decode step a captured CUDA graph (`arch.capture`)."""
    if threads:
        torch.set_num_threads(threads)
    folder = model_dir(model)
    dev = resolve_device(device)
    graphs = capture.resolve(cuda_graphs, dev)  # a usage error before the weights are read
    dt = resolve_dtype(dtype, dev)
    mf = ModelFolder.open(folder)
    tok = mf.tokenizer()  # a mismatched tokenizer fails before the weights are read
    m: Model = load_model(mf, dev, dt, quantize)  # type: ignore[assignment]
    log.info("loaded %s (%s) on %s (%s)", folder, mf.arch.name, dev, dt)
    engine = Engine(m, tok, dev, dt, mf)
    engine.memory = MemoryBudget(m, dt, quantize, max_memory, dev)
    if graphs:
        engine.capture_steps()
    return engine
