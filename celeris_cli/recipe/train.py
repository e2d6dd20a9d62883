"""Train a masked-diffusion LM in our checkpoint layout (LLaDA / MDLM objective), bidirectional or
block-causal (block diffusion).

Each row is `seq_len` tokens of packed documents (EOS between them), starting at a document start. Per
row a mask ratio t ~ U(eps, 1) is drawn, every token is masked with probability t, and the loss is the
cross-entropy on masked positions weighted by 1/t (LLaDA eq. 3). The LM head runs on masked positions
only. A share of rows keeps a random prefix unmasked, as a prompt would be at generation time.

Block diffusion (`block_sizes`, as SDAR and BD3-LM train): the row is cut into blocks of W tokens from its
position 0, and each block draws its own mask ratio. The network sees the row twice, clean then noisy,
with the same positions (`block_causal_mask`): a clean token sees the clean blocks up to its own (what a
decoder's cache of committed blocks holds), a noisy token sees the clean blocks before its own and its
own noisy block, nothing else. The loss is the 1/t-weighted cross-entropy on the noisy copy's masked
tokens. Each row draws W from `block_sizes`, so one model serves each of those block lengths.

Joint AR + block diffusion (`ar_weight` > 0, Nemotron-Labs-Diffusion's recipe on one network): the clean
copy attends causally (each token sees itself and those before it, what a causal pass writes into a
cache), and its position i is also trained to predict token i + 1 (the next-token cross-entropy, weighted
by `ar_weight`): that is the network's AR mode. A noisy block sees the clean tokens before it and its own
block; the blocks start at a random offset per row, as a draft block starts wherever the answer has got
to, and half of them are wholly masked, as the block of masks a speculative decoder appends after the text
it verifies (`decode.speculative`).

All randomness at step s comes from a generator seeded with (seed, s), so a resumed run draws the
same batches and masks and continues the same loss curve.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..arch.checkpoint import save_model
from ..arch.llada import LLaDAModel, ModelConfig
from ..device import cpu_has_bf16
from ..errors import UsageError

log = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    data: str  # folder with train.pt / heldout.pt from prepare_data
    out: str
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    mlp_hidden_size: int = 704
    seq_len: int = 128
    batch_size: int = 32
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 200
    steps: int = 4000
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    prefix_prob: float = 0.3
    eval_every: int = 250
    ckpt_every: int = 100
    seed: int = 0
    device: str = "cpu"
    bf16: bool = True
    tie_weights: bool = True
    block_sizes: list[int] = field(default_factory=list)  # empty: bidirectional (no blocks)
    ar_weight: float = 0.0  # > 0: joint AR + block diffusion over a causal clean copy (module text)
    init: str | None = None  # a model folder whose weights the run starts from
    special: dict[str, int] = field(default_factory=dict)


def prepare_data(corpus: Path, tokenizer_model: Path, out: Path) -> dict[str, int]:
    """Tokenize train.txt/heldout.txt once into flat int32 streams with EOS after each document."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_model))
    out.mkdir(parents=True, exist_ok=True)
    sizes = {}
    for split in ("train", "heldout"):
        docs = (corpus / f"{split}.txt").read_text(encoding="utf-8").splitlines()
        encoded = sp.encode([d for d in docs if d.strip()])
        starts: list[int] = []
        flat: list[int] = []
        for ids in encoded:
            starts.append(len(flat))
            flat.extend(ids)
            flat.append(sp.eos_id())
        torch.save(
            {"tokens": torch.tensor(flat, dtype=torch.int32), "starts": torch.tensor(starts, dtype=torch.int64)},
            out / f"{split}.pt",
        )
        sizes[split] = len(flat)
    if tokenizer_model.resolve() != (out / "tokenizer.model").resolve():
        shutil.copy(tokenizer_model, out / "tokenizer.model")
    return sizes


def get_batch(data: dict[str, torch.Tensor], batch: int, seq_len: int, g: torch.Generator) -> torch.Tensor:
    tokens, starts = data["tokens"], data["starts"]
    usable = starts[starts + seq_len <= len(tokens)]
    pick = usable[torch.randint(len(usable), (batch,), generator=g)]
    idx = pick[:, None] + torch.arange(seq_len)
    return tokens[idx].long()


def mask_batch(
    x: torch.Tensor, mask_id: int, g: torch.Generator, prefix_prob: float, eps: float = 1e-3
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward process: returns (noisy ids, mask, p_mask per row)."""
    B, L = x.shape
    t = torch.rand(B, generator=g)
    p = (1 - eps) * t + eps
    mask = torch.rand(B, L, generator=g) < p[:, None]
    keep = torch.randint(1, max(2, L // 4), (B,), generator=g)
    keep = torch.where(torch.rand(B, generator=g) < prefix_prob, keep, torch.zeros_like(keep))
    mask &= torch.arange(L)[None, :] >= keep[:, None]
    return torch.where(mask, mask_id, x), mask, p


def block_mask_batch(
    x: torch.Tensor,
    mask_id: int,
    g: torch.Generator,
    prefix_prob: float,
    sizes: list[int],
    eps: float = 1e-3,
    drafting: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward process per block: returns (noisy ids, mask, p_mask per position, block index per position).
    Each row draws its block length from `sizes` and each of its blocks its own mask ratio. `drafting`: the
    blocks start at a random offset per row, and half of them are wholly masked (the draft block a
    speculative decoder appends, `decode.speculative`)."""
    B, L = x.shape
    width = torch.tensor(sizes)[torch.randint(len(sizes), (B,), generator=g)]
    shift = (torch.rand(B, generator=g) * width).long() if drafting else torch.zeros(B, dtype=torch.long)
    block = (torch.arange(L)[None, :] + shift[:, None]) // width[:, None]  # (B, L) block index of each position
    t = torch.rand(B, L // min(sizes) + (2 if drafting else 1), generator=g)
    if drafting:
        t = torch.where(torch.rand(t.shape, generator=g) < 0.5, torch.ones_like(t), t)
    p = ((1 - eps) * t + eps).gather(1, block)
    mask = torch.rand(B, L, generator=g) < p
    keep = torch.randint(1, max(2, L // 4), (B,), generator=g)
    keep = torch.where(torch.rand(B, generator=g) < prefix_prob, keep, torch.zeros_like(keep))
    mask &= torch.arange(L)[None, :] >= keep[:, None]
    return torch.where(mask, mask_id, x), mask, p, block


def block_causal_mask(blk: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """(B, 1, 2L, 2L) bool, True = may attend, over [clean copy; noisy copy] of rows of L tokens whose
    positions are in blocks `blk` (B, L). Clean query in block b: clean keys in blocks <= b (`causal`: clean
    keys up to itself). Noisy query in block b: clean keys in blocks < b and noisy keys in block b."""
    L = blk.shape[1]
    b2 = torch.cat([blk, blk], 1)  # (B, 2L)
    noisy = torch.arange(2 * L, device=blk.device) >= L  # (2L,)
    qb, kb = b2[:, :, None], b2[:, None, :]
    qn, kn = noisy[None, :, None], noisy[None, None, :]
    if causal:
        i = torch.arange(2 * L, device=blk.device) % L
        own = (i[None, :, None] >= i[None, None, :]) & ~qn
    else:
        own = ~qn & (kb == qb)
    clean_key = ~kn & ((kb < qb) | own)
    noisy_key = kn & qn & (kb == qb)
    return (clean_key | noisy_key)[:, None]


def diffusion_loss(
    model: LLaDAModel,
    x: torch.Tensor,
    noisy: torch.Tensor,
    mask: torch.Tensor,
    p: torch.Tensor,
    blk: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum over masked positions of CE / p, divided by the number of tokens (an upper bound on NLL).
    p: (B,) per row, or (B, L) per position. With `blk` (B, L) block indices, block diffusion over
    [clean; noisy]."""
    return joint_loss(model, x, noisy, mask, p, blk)[0]


def joint_loss(
    model: LLaDAModel,
    x: torch.Tensor,
    noisy: torch.Tensor,
    mask: torch.Tensor,
    p: torch.Tensor,
    blk: torch.Tensor | None = None,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the diffusion loss `diffusion_loss` describes, the AR mode's next-token cross-entropy per predicted
    token or None). `causal` (with `blk`): the clean copy attends causally and its position i is read as the
    prediction of token i + 1."""
    ar = None
    if blk is None:
        h, _ = model.hidden(noisy)
    else:
        L = x.shape[1]
        pos = torch.arange(L, device=x.device).repeat(2).expand(x.shape[0], 2 * L)
        h, _ = model.hidden(torch.cat([x, noisy], 1), pos, block_causal_mask(blk, causal))
        if causal:
            ar = F.cross_entropy(model.head(h[:, : L - 1]).float().flatten(0, 1), x[:, 1:].flatten())
        h = h[:, L:]
    logits = model.head(h[mask]).float()  # only masked positions reach the LM head
    ce = F.cross_entropy(logits, x[mask], reduction="none")
    weight = (1.0 / p if p.dim() == 2 else (1.0 / p)[:, None]).expand_as(mask)[mask]
    return (ce * weight).sum() / x.numel(), ar


def noise_batch(
    x: torch.Tensor, mask_id: int, g: torch.Generator, prefix_prob: float, sizes: list[int], drafting: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The forward process of the run's objective: (noisy, mask, p, block indices or None)."""
    if sizes:
        return block_mask_batch(x, mask_id, g, prefix_prob, sizes, drafting=drafting)
    noisy, mask, p = mask_batch(x, mask_id, g, prefix_prob)
    return noisy, mask, p, None


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


@torch.no_grad()
def nll_bound(
    model: LLaDAModel,
    x: torch.Tensor,
    mask_id: int,
    g: torch.Generator,
    draws: int = 4,
    use_bf16: bool = False,
    rows: int = 64,
    sizes: list[int] | None = None,
    joint: bool = False,
) -> tuple[float, float | None]:
    """Monte-Carlo estimate of the diffusion NLL upper bound per token of the rows of `x` (CPU tensors,
    moved to the model's device a slice of `rows` at a time), and with `joint` the AR mode's NLL per
    predicted token. `sizes`: block diffusion's block lengths."""
    device = next(model.parameters()).device
    total, ar_total, ar_n = 0.0, 0.0, 0
    for _ in range(draws):
        for i in range(0, len(x), rows):
            xb = x[i : i + rows]
            noisy, mask, p, blk = noise_batch(xb, mask_id, g, 0.0, sizes or [], joint)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
                loss, ar = joint_loss(
                    model,
                    xb.to(device),
                    noisy.to(device),
                    mask.to(device),
                    p.to(device),
                    None if blk is None else blk.to(device),
                    joint,
                )
            total += loss.item() * xb.numel()
            if ar is not None:
                ar_total, ar_n = ar_total + ar.item() * len(xb), ar_n + len(xb)
    return total / (draws * x.numel()), (ar_total / ar_n if ar_n else None)


def heldout_nll(
    model: LLaDAModel,
    data: dict[str, torch.Tensor],
    mask_id: int,
    seq_len: int,
    rows: int = 64,
    draws: int = 4,
    use_bf16: bool = False,
    sizes: list[int] | None = None,
    joint: bool = False,
) -> tuple[float, float | None]:
    """The NLL bound (and with `joint` the AR NLL) on a fixed held-out batch, for the training log."""
    g = torch.Generator().manual_seed(1234)
    return nll_bound(model, get_batch(data, rows, seq_len, g), mask_id, g, draws, use_bf16, rows, sizes, joint)


def _step_generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def train(
    cfg: TrainConfig, resume: bool = True, show_progress: bool | None = None, stop_after: int | None = None
) -> list[dict]:
    """Run (or resume) training; returns the log records written this call."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    data_dir = Path(cfg.data)
    if not (data_dir / "train.pt").is_file():
        raise UsageError(f"{data_dir}: no train.pt (run prepare_data first)")
    if cfg.ar_weight > 0 and not cfg.block_sizes:
        raise UsageError("--ar-weight trains the AR mode beside block diffusion: give --block-size too")
    train_data = torch.load(data_dir / "train.pt", weights_only=True)
    held_data = torch.load(data_dir / "heldout.pt", weights_only=True)
    sp = cfg.special
    mcfg = ModelConfig(
        d_model=cfg.d_model,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        mlp_hidden_size=cfg.mlp_hidden_size,
        vocab_size=sp["vocab_size"],
        embedding_size=-(-sp["vocab_size"] // 64) * 64,
        max_sequence_length=max(512, cfg.seq_len),
        mask_token_id=sp["mask_token_id"],
        eos_token_id=sp["eos_token_id"],
        pad_token_id=sp["pad_token_id"],
        eot_token_id=sp.get("eot_token_id"),
        bos_token_id=sp.get("bos_token_id"),
        weight_tying=cfg.tie_weights,
        rope_theta=10000.0,
        block_causal=bool(cfg.block_sizes),
        causal_context=cfg.ar_weight > 0,
    )
    device = torch.device(cfg.device)
    torch.manual_seed(cfg.seed)
    model = LLaDAModel(mcfg)
    model.init_weights(generator=torch.Generator().manual_seed(cfg.seed))
    ckpt = out / "ckpt.pt"
    resuming = resume and ckpt.is_file()
    if resuming:
        _check_same_objective(out, cfg)
    elif cfg.init:  # a resumed run's weights come from its checkpoint
        _load_init(model, Path(cfg.init))
    model.to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    step = 0
    if resuming:
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
        log.info("resumed from %s at step %d", ckpt, step)
    (out / "train_config.json").write_text(json.dumps(asdict(cfg), indent=1), encoding="utf-8")
    use_bf16 = cfg.bf16 and (device.type == "cuda" or cpu_has_bf16())
    n_params = sum(p.numel() for p in model.parameters())
    log.info("model: %.2fM parameters, bf16 autocast: %s", n_params / 1e6, use_bf16)
    records: list[dict] = []
    log_path = out / "train_log.jsonl"
    if log_path.exists():  # records past the checkpoint were lost with the run that wrote them
        kept = [
            line
            for line in log_path.read_text(encoding="utf-8").splitlines()
            if line.strip() and _step_of(line) <= step
        ]
        log_path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    logf = open(log_path, "a", encoding="utf-8")
    progress = None
    if show_progress if show_progress is not None else sys.stderr.isatty():
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        progress = Progress(
            TextColumn("step {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
            transient=False,
        )
        task = progress.add_task("train", total=cfg.steps, completed=step, info="")
        progress.start()
    t0, tokens_seen = time.perf_counter(), 0
    try:
        while step < cfg.steps:
            g = _step_generator(cfg.seed, step)
            x = get_batch(train_data, cfg.batch_size, cfg.seq_len, g)
            joint = cfg.ar_weight > 0
            noisy, mask, p, blk = noise_batch(x, mcfg.mask_token_id, g, cfg.prefix_prob, cfg.block_sizes, joint)
            x, noisy, mask, p = x.to(device), noisy.to(device), mask.to(device), p.to(device)
            blk = None if blk is None else blk.to(device)
            for group in opt.param_groups:
                group["lr"] = lr_at(step, cfg)
            model.train()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
                loss, ar = joint_loss(model, x, noisy, mask, p, blk, joint)
                if ar is not None:
                    loss = loss + cfg.ar_weight * ar
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip).item()
            opt.step()
            step += 1
            tokens_seen += x.numel()
            rate = tokens_seen / (time.perf_counter() - t0)
            rec: dict = {
                "step": step,
                "loss": round(loss.item(), 4),
                "lr": round(lr_at(step - 1, cfg), 6),
                "grad_norm": round(gnorm, 3),
                **({} if ar is None else {"ar_loss": round(ar.item(), 4)}),
                "tokens_per_s": round(rate),
                "time": round(time.time()),
            }
            if step % cfg.eval_every == 0 or step == cfg.steps:
                model.eval()
                bound, ar_nll = heldout_nll(
                    model,
                    held_data,
                    mcfg.mask_token_id,
                    cfg.seq_len,
                    use_bf16=use_bf16,
                    sizes=cfg.block_sizes,
                    joint=joint,
                )
                rec["heldout_nll"] = round(bound, 4)
                if ar_nll is not None:
                    rec["heldout_ar_nll"] = round(ar_nll, 4)
            records.append(rec)
            logf.write(json.dumps(rec) + "\n")
            logf.flush()
            if progress is not None:
                progress.update(task, completed=step, info=f"loss {rec['loss']:.3f}  {rate:,.0f} tok/s")
            elif step % 20 == 0:
                log.info("step %d loss %.4f %.0f tok/s", step, rec["loss"], rate)
            if step % cfg.ckpt_every == 0 or step == cfg.steps or step == stop_after:
                save_checkpoint(model, opt, step, out, data_dir, Path(cfg.init) if cfg.init else None)
            if step == stop_after:  # an interruption, for the resume test
                break
    finally:
        logf.close()
        if progress is not None:
            progress.stop()
    return records


def _check_same_objective(out: Path, cfg: TrainConfig) -> None:
    """A run resumes with the block sizes it started with: another objective mid-curve (or a block-trained
    model exported as bidirectional) is a mistake, not a resume."""
    saved = out / "train_config.json"
    if not saved.is_file():
        return
    before = sorted(json.loads(saved.read_text(encoding="utf-8")).get("block_sizes", []))
    was_joint = json.loads(saved.read_text(encoding="utf-8")).get("ar_weight", 0.0) > 0
    if was_joint != (cfg.ar_weight > 0):
        raise UsageError(f"{out} was trained {'with' if was_joint else 'without'} the AR mode; resume it as it began")
    if before != sorted(cfg.block_sizes):
        raise UsageError(
            f"{out} was trained with block sizes {before or 'none (bidirectional)'}; resume it with the same "
            f"--block-size, or train into a new --out"
        )


def _load_init(model: LLaDAModel, folder: Path) -> None:
    """Start from a model folder's weights (same shape; its attention pattern may differ)."""
    from ..arch.checkpoint import load_model

    try:
        src = load_model(folder)
        model.load_state_dict(src.state_dict())
    except RuntimeError as e:  # shapes differ
        raise UsageError(f"{folder}: its weights do not fit this run's model ({str(e).splitlines()[0]})") from None
    log.info("started from the weights in %s", folder)


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        return 1 << 62  # a torn line is dropped


def run_recipe(corpus: Path, out: Path, **overrides: Any) -> list[dict]:
    """Tokenizer (once), tokenized data (once), then training; resumes from out/ckpt.pt."""
    from .vocab import special_ids, train_tokenizer

    data = out / "data"
    tok = data / "tokenizer.model"
    if not (corpus / "train.txt").is_file():
        raise UsageError(f"{corpus}: no train.txt; build the corpus first (celeris corpus)")
    if overrides.get("init"):  # a run that starts from a model keeps that model's tokenizer
        from ..engine import model_dir

        init = model_dir(overrides["init"])
        overrides["init"] = str(init)
        if not (init / "tokenizer.model").is_file():
            raise UsageError(f"{init}: no tokenizer.model to start from")
        if not tok.is_file():
            data.mkdir(parents=True, exist_ok=True)
            shutil.copy(init / "tokenizer.model", tok)
        elif tok.read_bytes() != (init / "tokenizer.model").read_bytes():
            raise UsageError(f"{data} holds another tokenizer than {init}'s; use a new --out to start from it")
    if not tok.is_file():
        fold_path = corpus / "t2s.json"
        fold = json.loads(fold_path.read_text(encoding="utf-8")) if fold_path.is_file() else None
        train_tokenizer(corpus / "train.txt", data, fold)
    if not (data / "train.pt").is_file():
        prepare_data(corpus, tok, data)
    cfg = TrainConfig(data=str(data), out=str(out), special=special_ids(tok), **overrides)
    return train(cfg)


def save_checkpoint(
    model: LLaDAModel, opt: torch.optim.Optimizer, step: int, out: Path, data_dir: Path, init: Path | None = None
) -> None:
    """Training state (resumable) and an exported model folder, each replaced atomically. A run started
    from a model folder (--init) exports that folder's generation settings with it, so the model decodes
    as its parent did rather than with the built-in defaults."""
    tmp = out / "ckpt.pt.tmp"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
    tmp.replace(out / "ckpt.pt")
    export = out / "model.tmp"
    shutil.rmtree(export, ignore_errors=True)
    save_model(model, export)
    shutil.copy(data_dir / "tokenizer.model", export / "tokenizer.model")
    if init is not None and (init / "generation_config.json").is_file() and _same_kind(init, model):
        shutil.copy(init / "generation_config.json", export / "generation_config.json")
    (export / "train_step.txt").write_text(f"{step}\n")
    final = out / "model"
    old = out / "model.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    export.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def _same_kind(init: Path, model: LLaDAModel) -> bool:
    """Whether the init folder's model is bidirectional or block-causal as `model` is: a bidirectional
    model's settings (its strategy) would not run on a block model, nor the other way round."""
    from ..arch.folder import ModelFolder
    from ..errors import CelerisError

    try:
        cfg = ModelFolder.open(init).cfg
    except (OSError, CelerisError):
        return False
    block = bool(getattr(cfg, "block_causal", False))
    return block == bool(model.cfg.block_causal) and bool(getattr(cfg, "causal_context", False)) == bool(
        model.cfg.causal_context
    )


def plot_log(log_path: Path, png: Path, title: str = "celeris-tiny training curve") -> None:
    """Training loss and held-out NLL bound against tokens seen (and a joint run's AR loss and held-out AR
    NLL), as a PNG (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("plotting needs matplotlib: pip install '.[train]'") from None
    records = {}
    for line in log_path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            rec = json.loads(line)
            records[rec["step"]] = rec
    steps = sorted(records)
    cfg_path = log_path.parent / "train_config.json"
    tokens_per_step = 1
    if cfg_path.is_file():
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        tokens_per_step = cfg["batch_size"] * cfg["seq_len"]
    x = [s * tokens_per_step / 1e6 for s in steps]
    fig, ax = plt.subplots(figsize=(7, 4))
    joint = any("ar_loss" in records[s] for s in steps)
    label = "train loss (NLL bound + ar_weight x AR loss)" if joint else "train loss (NLL bound)"
    ax.plot(x, [records[s]["loss"] for s in steps], lw=0.6, alpha=0.6, label=label)
    held = [s for s in steps if "heldout_nll" in records[s]]
    ax.plot(
        [s * tokens_per_step / 1e6 for s in held],
        [records[s]["heldout_nll"] for s in held],
        "o-",
        label="held-out NLL bound",
    )
    if joint:  # its AR mode's figures beside
        ar_steps = [s for s in steps if "ar_loss" in records[s]]
        ax.plot(
            [s * tokens_per_step / 1e6 for s in ar_steps],
            [records[s]["ar_loss"] for s in ar_steps],
            lw=0.6,
            alpha=0.6,
            label="train AR loss (next-token NLL)",
        )
        ar_held = [s for s in steps if "heldout_ar_nll" in records[s]]
        ax.plot(
            [s * tokens_per_step / 1e6 for s in ar_held],
            [records[s]["heldout_ar_nll"] for s in ar_held],
            "s-",
            label="held-out AR NLL",
        )
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("nats per token")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
