"""Tiny real artifacts, built inside the test session: a sentencepiece tokenizer trained on a few lines
and a 2-layer random LLaDA-layout model saved as safetensors."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

# One torch thread in the tests and the processes they start: their models are tiny, and two OpenMP threads
# spinning on each small op wait for a core whenever anything runs beside the suite (measured: a running-set
# decode of one row took 4.4 s with two threads beside another job, 0.34 s with one). Set before torch loads.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests that start a local Ray run on one xdist worker (`--dist loadgroup`, pyproject's addopts):
    two Ray clusters at once would each want the machine's CPUs and its `/tmp/ray` session folder."""
    for item in items:
        name = getattr(item, "originalname", item.name)
        if item.path.name == "test_spool_ray.py" or re.search(r"(^|_)ray(_|$)", name):
            item.add_marker(pytest.mark.xdist_group("ray"))


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread() -> None:
    """One torch thread in each xdist worker too, should torch have been imported before OMP_NUM_THREADS
    was set (a plugin, an environment that set it higher)."""
    import torch

    torch.set_num_threads(1)


LINES = [
    "床前明月光，疑是地上霜。举头望明月，低头思故乡。",
    "白日依山尽，黄河入海流。欲穷千里目，更上一层楼。",
    "春眠不觉晓，处处闻啼鸟。夜来风雨声，花落知多少。",
    "To be, or not to be: that is the question.",
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
] * 4


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep every test out of the real home folder."""
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from celeris_cli.recipe.vocab import train_tokenizer

    root = tmp_path_factory.mktemp("tok")
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    return train_tokenizer(corpus, root, fold={"舉": "举"}, han_chars=200, bpe_pieces=60)


def make_model(
    folder: Path,
    tokenizer_model: Path,
    seed: int = 0,
    n_layers: int = 2,
    max_shard_bytes: int | None = None,
    **overrides: object,
) -> Path:
    import shutil

    import torch

    from celeris_cli.arch.checkpoint import save_model
    from celeris_cli.arch.llada import LLaDAModel, ModelConfig
    from celeris_cli.recipe.vocab import special_ids

    sp = special_ids(tokenizer_model)
    cfg = dict(
        d_model=32,
        n_layers=n_layers,
        n_heads=4,
        mlp_hidden_size=64,
        vocab_size=sp["vocab_size"],
        max_sequence_length=256,
        mask_token_id=sp["mask_token_id"],
        eos_token_id=sp["eos_token_id"],
        pad_token_id=sp["pad_token_id"],
        eot_token_id=sp["eot_token_id"],
        bos_token_id=sp["bos_token_id"],
    )
    cfg.update(overrides)
    model = LLaDAModel(ModelConfig(**cfg))  # type: ignore[arg-type]
    model.init_weights(std=0.5, generator=torch.Generator().manual_seed(seed))
    save_model(model, folder, max_shard_bytes=max_shard_bytes)
    shutil.copy(tokenizer_model, folder / "tokenizer.model")
    return folder


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Path) -> Path:
    return make_model(tmp_path_factory.mktemp("model") / "tiny", tiny_tokenizer)


@pytest.fixture(scope="session")
def engine(tiny_model: Path):  # type: ignore[no-untyped-def]
    from celeris_cli import load_engine

    return load_engine(tiny_model, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def eos_prone(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Path):  # type: ignore[no-untyped-def]
    """A random model whose EOS logit is amplified, so rows end at different places."""
    from safetensors.torch import load_file, save_file

    folder = make_model(tmp_path_factory.mktemp("eos") / "m", tiny_tokenizer, seed=9)
    state = load_file(str(folder / "model.safetensors"))
    eos = 2
    head = state["model.transformer.ff_out.weight"]
    head[eos] = head[eos] * 2.5 + head.mean(0)
    save_file(state, str(folder / "model.safetensors"))
    from celeris_cli import load_engine

    return load_engine(folder, device="cpu", dtype="float32")


class LogitsFake:
    """Base of a fake at the model boundary that gives whole-canvas logits, `__call__(ids, key_mask,
    positions) -> (B, T, V)`: `Net` asks a model for hidden states and its LM head apart, so the logits stand
    for the hidden states and the head passes them through. Subclasses set `cfg`."""

    logit_shift = 0

    def hidden(self, ids, positions=None, key_mask=None, cache=None, start=0, keep_kv=True):  # type: ignore[no-untyped-def]
        assert cache is None, "a whole-canvas fake has no cache"
        return self(ids, key_mask, positions), []  # type: ignore[operator]

    def head(self, h):  # type: ignore[no-untyped-def]
        return h

    def step_head(self):  # type: ignore[no-untyped-def]
        return self.head


def family_head(engine):  # type: ignore[no-untyped-def]
    """The engine with every row of its LM head (`DiffusionLM.limit_head(None)`), for a comparison with a family's
    own code, which normalises over the rows past the tokenizer too: a tiny random checkpoint gives them real
    mass (a trained one next to none), which moves confidences and entropies and so the order positions commit
    in. Celeris itself cuts them (tests/test_padded_head.py)."""
    engine.model.limit_head(None)
    return engine


def write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data), encoding="utf-8")


def plan(strategy: str = "reference", **settings: object):  # type: ignore[no-untyped-def]
    """A decoder's plan (exactly the parts its strategy honours) from settings, validated as users' are."""
    from celeris_cli.decode.strategies import plan_for
    from celeris_cli.params import GenerationParams

    return plan_for(GenerationParams.from_mapping({"strategy": strategy, **settings}))


def noise(rows: int, seed: int = 0):  # type: ignore[no-untyped-def]
    import torch

    from celeris_cli.decode.sampling import RowNoise

    return RowNoise([seed] * rows, torch.device("cpu"))


def predicting_the_mask(model, mask_id: int, limit: int, calls: list[int]):  # type: ignore[no-untyped-def]
    """`model.step_head`, except that every position's likeliest token is the mask itself (which commits
    nothing); counts the head's calls in calls[0] and raises past `limit` of them (a decoder stepping
    forever)."""
    step_head = model.step_head

    def ready():  # type: ignore[no-untyped-def]
        head = step_head()

        def predicts_the_mask(h):  # type: ignore[no-untyped-def]
            calls[0] += 1
            if calls[0] > limit:
                raise RuntimeError("the block never ended")
            logits = head(h).clone()
            logits[..., mask_id] = 1e4
            return logits

        return predicts_the_mask

    return ready


def decoded_alone(engine, prompt: str, params, seed: int) -> list[int]:  # type: ignore[no-untyped-def]
    """The generated ids (uncut) of one request decoded alone by its strategy's own decoder, called directly
    (`decode.strategies`), never through a running set: the oracle the running sets are tested against."""
    import torch

    from celeris_cli.decode.sampling import RowNoise, request_seed
    from celeris_cli.decode.strategies import Net, get_strategy

    ids = engine.encode_prompt(prompt)
    x = torch.tensor([ids], device=engine.device)
    noise = RowNoise([request_seed(seed, ids)], engine.device)
    special = engine._special(params)
    if params.strategy == "block-fast":  # its decoder is the running set: the static cached loop instead
        from celeris_cli.decode.strategies import plan_for

        from .block_oracle import block_cached_alone

        plan = plan_for(params)
        out = block_cached_alone(Net(engine.model), x, torch.ones_like(x, dtype=torch.bool), plan, special.mask_id,
                                 special.stop_ids, noise, special.word_pieces)  # fmt: skip
        return out[0, len(ids) : len(ids) + params.gen_length].tolist()  # type: ignore[no-any-return]
    out = get_strategy(params.strategy)(Net(engine.model), x, torch.ones_like(x, dtype=torch.bool), params,
                                        special, noise)  # fmt: skip
    return out[0, len(ids) : len(ids) + params.gen_length].tolist()  # type: ignore[no-any-return]
