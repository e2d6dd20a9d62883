"""`celeris bench`: reference decoding and every fast mode side by side, in one process, on the same model,
prompts, batch size and lengths; speed and quality measured on the same outputs.

Speed is never asserted in tests: this command prints figures (tokens/s, wall time, NFE, tokens per
forward, peak memory) together with quality (structure rate, distinct-2) and the ratio to the model's raw
forward throughput. Its header records hardware, torch, threads, dtype and every length.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from ..arch.kv import KVCache
from ..engine import Engine, GenerationParams
from ..params import honoured
from .evaluate import EvalSet, poem_quality

# name -> overrides on top of the model's defaults. The baseline is LLaDA's reference decoding.
MODES: dict[str, dict[str, Any]] = {
    "reference": {"strategy": "reference"},
    "threshold": {"strategy": "fast", "cache": "none", "early_exit": False},
    "threshold+exit": {"strategy": "fast", "cache": "none", "early_exit": True},
    "prefix-cache": {"strategy": "fast", "cache": "prefix", "early_exit": True},
    "dual-cache": {"strategy": "fast", "cache": "dual", "early_exit": True},
}
# the default mode is the fast row with the settings' cache (the model's own unless `--set` names one)
BY_CACHE = {"none": "threshold+exit", "prefix": "prefix-cache", "dual": "dual-cache"}
# block-diffusion families (LLaDA2): the reference recomputes the prefix at every step; block-fast caches it
BLOCK_MODES: dict[str, dict[str, Any]] = {"block": {"strategy": "block"}, "block-fast": {"strategy": "block-fast"}}
# one checkpoint decoded left to right, by diffusion and by speculation (Nemotron-Labs-Diffusion, a model
# trained with --ar-weight): its own AR mode is the baseline; the modes its architecture runs
SEEDED_MODES: dict[str, dict[str, Any]] = {
    "ar": {"strategy": "ar"},
    "nemotron": {"strategy": "nemotron"},
    "nemotron-spec": {"strategy": "nemotron-spec"},
    "spec": {"strategy": "spec"},
}


def modes_for(engine: Engine, settings: dict[str, Any] | None = None) -> tuple[dict[str, dict[str, Any]], str]:
    """The modes a model's architecture runs, the first being the baseline, and the default mode (for a
    masked-diffusion model, the fast row with the cache of the model's settings, `settings` over its
    defaults; their other knobs, the suffix window among them, hold in every row)."""
    if "block" in engine.arch.strategies:
        return BLOCK_MODES, "block-fast"
    if "ar" in engine.arch.strategies:
        runs = {k: v for k, v in SEEDED_MODES.items() if v["strategy"] in engine.arch.strategies}
        default = engine.params(settings or {}).strategy  # the model folder's (celeris-spec's: nemotron)
        return runs, default if default in runs else engine.arch.default_strategy
    return MODES, BY_CACHE[engine.params(settings or {}).cache]


class PeakRSS:
    """Peak resident memory while a block runs, above what was resident before it (CPU); on CUDA the
    allocator's own peak is used."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = 0
        self._stop = threading.Event()

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __enter__(self) -> PeakRSS:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            return self
        self.base = self.rss()
        self.peak = self.base

        def sample() -> None:
            while not self._stop.wait(0.01):
                self.peak = max(self.peak, self.rss())

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            self.peak_bytes = torch.cuda.max_memory_allocated()
            return
        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(0, self.peak - self.base)


def hardware() -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def raw_forward_tokens_per_s(engine: Engine, batch: int, length: int, repeats: int = 5) -> float:
    """Tokens/s through one plain full forward at this batch and canvas length: the machine's limit for a
    decoder that must look at every token once per output token batch."""
    ids = torch.randint(10, engine.model.cfg.vocab_size, (batch, length), device=engine.device)
    mask = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        engine.model(ids, mask)  # warm-up
        t0 = time.perf_counter()
        for _ in range(repeats):
            engine.model(ids, mask)
        _sync(engine.device)
    return batch * length * repeats / (time.perf_counter() - t0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def autoregressive_limit(
    engine: Engine, n_prompts: int, batch_size: int, prompt_length: int, gen_length: int
) -> dict[str, Any]:
    """Output tokens/s of the same network decoded the way an autoregressive model is: one position per
    row per forward against a KV cache (after one forward over the prompt), greedy. Timing only: the model
    was not trained to predict left to right, so the text means nothing; `positions_per_output_token` is
    the prompt's share above 1.0. It is the yardstick a diffusion decoder's tokens/s is shown against."""
    model, device = engine.model, engine.device
    L = prompt_length + gen_length
    wall = 0.0
    with torch.no_grad(), PeakRSS(device) as mem:
        for start in range(0, n_prompts, batch_size):
            B = min(batch_size, n_prompts - start)
            ids = torch.randint(10, model.cfg.vocab_size, (B, L), device=device)
            pos = torch.arange(L, device=device).expand(B, L)
            keys = torch.ones(B, L, dtype=torch.bool, device=device)
            t0 = time.perf_counter()
            h, kv = model.hidden(ids[:, :prompt_length], pos[:, :prompt_length], keys[:, :prompt_length])
            ids[:, prompt_length] = model.head(h[:, -1]).argmax(-1)  # the first output token
            # the whole length allocated once; each step writes one position in place
            k0 = kv[0][0]
            dtype = torch.float32 if _upcast(model, k0) else k0.dtype
            cache = KVCache.empty(len(kv), B, k0.shape[1], L, k0.shape[3], dtype, k0.device)
            for (ck, cv), (k, v) in zip(cache.layers, kv):
                ck[:, :, :prompt_length], cv[:, :, :prompt_length] = k, v
            for t in range(prompt_length, L - 1):  # the token at t goes in, the one at t + 1 comes out
                window = cache.view(length=t + 1)
                h, _ = model.hidden(ids[:, t : t + 1], pos[:, t : t + 1], keys[:, : t + 1], window, t)
                ids[:, t + 1] = model.head(h[:, -1]).argmax(-1)
            _sync(device)
            wall += time.perf_counter() - t0
    out_tokens = n_prompts * gen_length
    return {
        "wall_s": round(wall, 3),
        "output_tokens": out_tokens,
        "tokens_per_s": round(out_tokens / wall, 1),
        "nfe": -(-n_prompts // batch_size) * gen_length,
        "positions_per_output_token": round(n_prompts * (L - 1) / out_tokens, 3),
        "peak_mem_mb": round(mem.peak_bytes / 2**20, 1),
        "quality": "not meaningful: the model was not trained to decode left to right",
    }


def _upcast(model: Any, k: torch.Tensor) -> bool:
    return bool(getattr(model, "upcast", False)) and k.dtype != torch.float32


def run_mode(engine: Engine, prompts: list[str], params: GenerationParams, batch_size: int) -> dict[str, Any]:
    positions_before, forwards_before = engine.positions_computed, engine.forwards_run
    with PeakRSS(engine.device) as mem:
        t0 = time.perf_counter()
        results = engine.generate(prompts, params, batch_size=batch_size)
        _sync(engine.device)
        wall = time.perf_counter() - t0
    nfe = engine.forwards_run - forwards_before  # every forward once, in static batches or a running set
    out_tokens = sum(r.output_tokens for r in results)
    positions = engine.positions_computed - positions_before
    quality = poem_quality(prompts, [r.text for r in results], [r.finish_reason for r in results])
    return {
        "wall_s": round(wall, 3),
        "output_tokens": out_tokens,
        "tokens_per_s": round(out_tokens / wall, 1),
        "nfe": nfe,
        "tokens_per_forward": round(out_tokens / max(nfe, 1), 2),
        "positions_per_output_token": round(positions / max(out_tokens, 1), 1),
        "peak_mem_mb": round(mem.peak_bytes / 2**20, 1),
        **{k: round(v, 4) for k, v in quality.items()},
        "texts": [r.text for r in results],
    }


def agreement(a: list[str], b: list[str]) -> dict[str, float]:
    """How often two decodings of the same prompts differ: identical rows, and per-character agreement."""
    same = sum(x == y for x, y in zip(a, b))
    chars = sum(max(len(x), len(y)) for x, y in zip(a, b))
    match = sum(sum(p == q for p, q in zip(x, y)) for x, y in zip(a, b))
    return {"identical_rows": round(same / len(a), 4), "char_agreement": round(match / max(chars, 1), 4)}


def bench(
    engine: Engine,
    n_prompts: int = 32,
    batch_size: int = 16,
    gen_length: int = 256,
    block_length: int = 32,
    steps: int | None = None,
    modes: list[str] | None = None,
    settings: dict[str, Any] | None = None,
    cache_agreement: bool = True,
    versus: Engine | None = None,
) -> dict[str, Any]:
    """`versus`: another model whose baseline and default mode are decoded on the same prompts, batch size,
    gen_length and dtype, each with its own defaults otherwise; every mode's tokens/s is then also shown as
    a multiple of that model's baseline (`x_versus_baseline`)."""
    evalset = EvalSet.load()
    prompts = [r["prompt"] for r in evalset.poems[:n_prompts]]
    table, default_mode = modes_for(engine, settings)
    baseline = next(iter(table))
    seeded = "ar" in table
    if table is BLOCK_MODES or seeded:
        steps_knob = {"block_steps": steps} if steps else {}
    else:
        steps_knob = {"denoise_steps": steps or gen_length}
    layer: dict[str, Any] = {**(settings or {}), "gen_length": gen_length, "block_length": block_length, **steps_knob}
    if seeded:  # the settings as the diffusion mode (which honours the most) reads them; each mode keeps its own
        layer.setdefault("strategy", "nemotron")
    base = engine.params(layer)

    def mode(name: str, params: GenerationParams) -> GenerationParams:
        """The mode's settings over `params`; the AR and speculative modes of a seeded table keep only the
        knobs they honour (no steps; the AR mode no blocks either)."""
        if seeded and name != "nemotron":
            strategy = table[name]["strategy"]
            return engine.params(
                {**{k: v for k, v in params.report().items() if k in honoured(strategy)}, "strategy": strategy}
            )
        return params.with_(**table[name])

    lengths = [len(engine.encode_prompt(p)) for p in prompts]
    if "spec" in table:
        engine.forward_cost()  # self-speculation's cost model, calibrated once before anything is timed
    report: dict[str, Any] = {
        "hardware": hardware(),
        "device": str(engine.device),
        "dtype": str(engine.dtype).replace("torch.", ""),
        "model": str(engine.model_dir),
        "prompts": len(prompts),
        "batch_size": batch_size,
        "prompt_tokens": {"min": min(lengths), "mean": round(sum(lengths) / len(lengths), 1), "max": max(lengths)},
        "gen_length": gen_length,
        "block_length": block_length,
        "denoise_steps": base.steps_per_block[0] if table is not MODES else base.denoise_steps,
        "architecture": engine.arch.name,
        "settings": {k: v for k, v in base.report().items() if k not in ("strategy", "cache", "early_exit")},
        "default_mode": default_mode,
        "modes": {},
    }
    canvas = max(lengths) + gen_length
    report["raw_forward_tokens_per_s"] = round(raw_forward_tokens_per_s(engine, batch_size, canvas), 1)
    ar = autoregressive_limit(engine, len(prompts), batch_size, max(lengths), gen_length)
    report["autoregressive_limit"] = ar
    for name in modes or list(table):
        report["modes"][name] = run_mode(engine, prompts, mode(name, base), batch_size)
    if versus is not None:
        report["versus"] = versus_rows(versus, prompts, gen_length, batch_size)
    ref = report["modes"].get(baseline)
    other = report["versus"]["modes"][report["versus"]["baseline"]] if versus is not None else None
    for m in [*report["modes"].values(), *(report["versus"]["modes"].values() if versus is not None else [])]:
        if other:
            m["x_versus_baseline"] = round(m["tokens_per_s"] / other["tokens_per_s"], 2)
    for m in report["modes"].values():
        if ref:
            m["speedup"] = round(m["tokens_per_s"] / ref["tokens_per_s"], 2) if ref["tokens_per_s"] else None
            m["structure_delta_pts"] = round(100 * (m["structure_rate"] - ref["structure_rate"]), 1)
            m["distinct_2_delta_pts"] = round(100 * (m["distinct_2"] - ref["distinct_2"]), 1)
        m["of_raw_forward"] = round(m["tokens_per_s"] / report["raw_forward_tokens_per_s"], 4)
        m["of_ar_limit"] = round(m["tokens_per_s"] / ar["tokens_per_s"], 4)
    if cache_agreement:  # the default mode against the baseline, both greedy, on the same prompts
        greedy = base.with_(temperature=0.0)
        texts = {m: run_mode(engine, prompts, mode(m, greedy), batch_size)["texts"] for m in (baseline, default_mode)}
        report["greedy_agreement_with_reference"] = {default_mode: agreement(texts[baseline], texts[default_mode])}
    if cache_agreement and table is MODES:
        greedy = base.with_(temperature=0.0, strategy="fast", early_exit=False)
        texts = {
            c: run_mode(engine, prompts, greedy.with_(cache=c), batch_size)["texts"] for c in ("none", "prefix", "dual")
        }
        report["cache_agreement_temperature_0"] = {c: agreement(texts["none"], texts[c]) for c in ("prefix", "dual")}
    for m in report["modes"].values():
        m.pop("texts")
    return report


def versus_rows(engine: Engine, prompts: list[str], gen_length: int, batch_size: int) -> dict[str, Any]:
    """Another model's baseline and default mode on the same prompts, with its own defaults otherwise
    (`--set` is the bench model's alone)."""
    table, default_mode = modes_for(engine)
    baseline = next(iter(table))
    base = engine.params({"gen_length": gen_length})
    modes = {}
    for name in dict.fromkeys((baseline, default_mode)):
        modes[name] = run_mode(engine, prompts, base.with_(**table[name]), batch_size)
        modes[name].pop("texts")
    return {
        "model": str(engine.model_dir),
        "architecture": engine.arch.name,
        "baseline": baseline,
        "settings": {k: v for k, v in base.report().items() if k not in ("strategy", "cache", "early_exit")},
        "modes": modes,
    }


def bench_batch(
    n_prompts: int, batch_size: int, work: Path, engine_options: dict[str, Any], actors: tuple[int, ...] = (1, 2)
) -> dict[str, Any]:
    """`celeris batch` over one file of held-out prompts (mixed lengths, one seed each): local, then on a local
    Ray with each actor count, in one process. Wall times include Ray's start and the actors' model loads, as
    a user sees them; the texts of every run must equal the local run's."""
    from ..batch import run_file
    from ..batch.local import LocalExecutor
    from ..batch.ray_pool import RayExecutor, RayOptions
    from ..spool.backend import EngineBackend

    evalset = EvalSet.load()
    pool = [r["prompt"] for pair in zip(evalset.poems, evalset.english) for r in pair]
    source = work / "requests.jsonl"
    source.write_text(
        "".join(json.dumps({"id": f"p{i}", "prompt": pool[i % len(pool)], "seed": i}) + "\n" for i in range(n_prompts)),
        encoding="utf-8",
    )
    o = engine_options
    runs: dict[str, Any] = {}
    texts: dict[str, list[str]] = {}
    backend = EngineBackend(o.get("model"), o.get("device", "auto"), o.get("dtype", "auto"), None, {})
    executors: list[tuple[str, Any]] = [("local", LocalExecutor(backend, batch_size))]
    executors += [
        (f"ray-actors-{n}", RayExecutor(RayOptions(actors=n, batch_size=batch_size, engine=o))) for n in actors
    ]
    for name, executor in executors:
        out = work / f"{name}.jsonl"
        report = run_file(source, out, work / f"{name}.failed.jsonl", executor)
        texts[name] = [json.loads(x)["response"]["body"]["text"] for x in out.read_text(encoding="utf-8").splitlines()]
        runs[name] = {"wall_s": report.wall_s, "prompts_per_s": report.prompts_per_s, "results": report.results}
    local = runs["local"]["prompts_per_s"]
    for name, r in runs.items():
        r["identical_to_local"] = texts[name] == texts["local"]
        r["agreement_with_local"] = agreement(texts["local"], texts[name])
        r["overhead_vs_local"] = round(local / r["prompts_per_s"] - 1, 4) if r["prompts_per_s"] else None
    return {"hardware": hardware(), "prompts": n_prompts, "batch_size": batch_size, "engine": o, "runs": runs}


def render(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    # piped, Rich would squeeze the table into 80 columns and cut names to `refe…`; give it room instead
    console = Console(width=None if sys.stdout.isatty() else 10_000)
    hw = report["hardware"]
    console.print(
        f"[bold]celeris bench[/] {hw['cpu']} ({hw['cores']} cores, {hw['threads']} threads), torch "
        f"{hw['torch']}, {report['device']} {report['dtype']}"
    )
    window = report["settings"].get("suffix_window")
    console.print(
        f"prompts {report['prompts']} (tokens {report['prompt_tokens']}), batch {report['batch_size']}, "
        f"gen_length {report['gen_length']}, block_length {report['block_length']}, steps "
        f"{report['denoise_steps']}{f', suffix window {window}' if window else ''}; "
        f"raw forward {report['raw_forward_tokens_per_s']:,.0f} tokens/s"
    )
    cols = [
        "mode",
        "tokens/s",
        "speedup",
        "wall s",
        "NFE",
        "tok/fwd",
        "pos/out tok",
        "peak MB",
        "structure",
        "distinct-2",
        "of raw fwd",
        "of AR limit",
    ]
    versus = report.get("versus")
    if versus:
        cols.append(f"x {Path(versus['model']).name} {versus['baseline']}")
    table = Table()
    for c in cols:
        table.add_column(c, justify="right" if c != "mode" else "left")
    rows = list(report["modes"].items())
    if versus:
        rows += [(f"{Path(versus['model']).name}: {n}", m) for n, m in versus["modes"].items()]
    for name, m in rows:
        cells = [
            f"{name} (default)" if name == report["default_mode"] else name,
            f"{m['tokens_per_s']:.1f}",
            f"{m.get('speedup', '')}",
            f"{m['wall_s']:.2f}",
            str(m["nfe"]),
            f"{m['tokens_per_forward']:.2f}",
            f"{m['positions_per_output_token']:.1f}",
            f"{m['peak_mem_mb']:.0f}",
            f"{m['structure_rate']:.3f}",
            f"{m['distinct_2']:.3f}",
            f"{m['of_raw_forward']:.4f}" if "of_raw_forward" in m else "",  # the versus rows have neither
            f"{m['of_ar_limit']:.3f}" if "of_ar_limit" in m else "",
        ]
        if versus:
            cells.append(f"{m['x_versus_baseline']:.2f}")
        table.add_row(*cells)
    ar = report["autoregressive_limit"]
    table.add_row(
        "autoregressive-limit (timing only)",
        f"{ar['tokens_per_s']:.1f}",
        "",
        f"{ar['wall_s']:.2f}",
        str(ar["nfe"]),
        "",
        f"{ar['positions_per_output_token']:.2f}",
        f"{ar['peak_mem_mb']:.0f}",
        "n/a",
        "n/a",
        f"{ar['tokens_per_s'] / report['raw_forward_tokens_per_s']:.4f}",
        "1.000",
        *([f"{ar['tokens_per_s'] / versus['modes'][versus['baseline']]['tokens_per_s']:.2f}"] if versus else []),
    )
    console.print(table)
    console.print(
        "autoregressive-limit: the same network decoding one position per row per forward with a KV cache; "
        "quality is not meaningful there (the model was not trained left to right)."
    )
    if "greedy_agreement_with_reference" in report:
        console.print("greedy, default mode vs reference: " + str(report["greedy_agreement_with_reference"]))
    if "cache_agreement_temperature_0" in report:
        console.print("cache vs no cache at temperature 0: " + str(report["cache_agreement_temperature_0"]))


def bench_queue(engine: Engine, n_files: int, batch_size: int, params: GenerationParams, work: Path) -> dict[str, Any]:
    """Queue overhead: n one-prompt files through `watch --once` versus the engine alone on the same prompts."""
    import json

    from ..spool.backend import EngineBackend
    from ..spool.config import parse_config
    from ..spool.daemon import Spool

    evalset = EvalSet.load()
    prompts = [evalset.poems[i % len(evalset.poems)]["prompt"] for i in range(n_files)]
    t0 = time.perf_counter()
    engine.generate(prompts, params, batch_size=batch_size)
    engine_wall = time.perf_counter() - t0
    for d in ("batch_inputs", "batch_outputs", "batch_processed", "logs"):
        (work / d).mkdir(parents=True, exist_ok=True)
    for i, p in enumerate(prompts):
        (work / "batch_inputs" / f"p{i:05d}.txt").write_text(p + "\n", encoding="utf-8")
    past = time.time() - 60
    for f in (work / "batch_inputs").iterdir():
        os.utime(f, (past, past))
    cfg = parse_config({"batch_size": batch_size, "batch_window_s": 0, "token_budget": 10**9}, work / "batch.yaml")
    backend = EngineBackend.__new__(EngineBackend)  # reuse the loaded engine
    backend.engine, backend.base = engine, params
    t0 = time.perf_counter()
    Spool(cfg, lambda: backend).run(once=True)
    queue_wall = time.perf_counter() - t0
    events = [json.loads(x) for x in (work / "logs" / "events.jsonl").read_text().splitlines()]
    sizes = [e["size"] for e in events if e["event"] == "batch"]
    return {
        "files": n_files,
        "batch_sizes": sizes,
        "engine_wall_s": round(engine_wall, 3),
        "queue_wall_s": round(queue_wall, 3),
        "overhead": round(queue_wall / engine_wall - 1, 4),
    }
