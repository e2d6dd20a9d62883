"""A pinned sample of JSONSchemaBench (tests/data/jsonschemabench, its provenance and licence in its README):
Celeris accepts every schema llguidance alone compiles, refuses by name what it cannot hold exactly (a `oneOf`
llguidance refuses as written), never lets its grammar accept one of the benchmark's invalid instances, and
every answer the embedded model finishes `stop` under these schemas validates against the schema as given
(`jsonschema`, the oracle: it shares no code with the grammar engine)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from typer.testing import CliRunner

from celeris_cli.cli import app
from celeris_cli.engine import Engine, load_engine
from celeris_cli.measure.coverage import celeris_accepts, holds, llguidance_alone, vocabulary_of

SAMPLE = Path(__file__).parent / "data" / "jsonschemabench"
FILES = sorted(SAMPLE.glob("*.json"))
ONE_OF = ("Github_trivial---o19070.json", "Github_trivial---o42159.json")  # compiled only when closed inside oneOf
UNDECLARED = ("Github_easy---o43083.json", "Github_easy---o27044.json")  # `required` names an undeclared key
LARGE = "Kubernetes---kb_710_Normalized.json"  # 76 KB: over the old 64 KiB cap


def _read(path: Path) -> tuple[Any, list[tuple[Any, bool]]]:
    data = json.loads(path.read_text(encoding="utf-8"))
    return data["schema"], [(t["data"], t["valid"]) for t in data["tests"]]


@pytest.fixture(scope="module")
def vocab() -> Any:
    return vocabulary_of(None)


def test_the_sample_is_what_its_readme_says() -> None:
    assert len(FILES) == 42
    names = {p.name for p in FILES}
    assert {*ONE_OF, *UNDECLARED, LARGE} <= names
    assert len({n.split("---")[0] for n in names}) == 10


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_celeris_accepts_what_llguidance_alone_compiles(path: Path, vocab: Any) -> None:
    schema, _ = _read(path)
    spec, why = celeris_accepts(schema, vocab)
    if llguidance_alone(schema, vocab):
        assert spec is not None, why


def test_a_one_of_the_engine_cannot_hold_exactly_is_refused_by_name(vocab: Any) -> None:
    """Closed inside `oneOf`, these compiled, and an answer matching one closed alternative could match two as
    written; as written llguidance refuses them, and so does Celeris, naming oneOf."""
    for name in ONE_OF:
        schema, _ = _read(SAMPLE / name)
        spec, why = celeris_accepts(schema, vocab)
        assert spec is None and why is not None and "oneOf" in why, name


def test_required_keys_that_properties_do_not_declare_are_allowed(vocab: Any) -> None:
    for name in UNDECLARED:
        schema, tests = _read(SAMPLE / name)
        spec, why = celeris_accepts(schema, vocab)
        assert spec is not None, why
    small = {"type": "object", "properties": {}, "required": ["top"]}
    spec, why = celeris_accepts(small, vocab)
    assert spec is not None, why
    assert holds(spec, {"top": [1, "x"]}, vocab) and not holds(spec, {}, vocab)


def test_a_kubernetes_schema_over_64_kib_compiles(vocab: Any) -> None:
    schema, _ = _read(SAMPLE / LARGE)
    assert len(json.dumps(schema, separators=(",", ":"))) > 64 * 1024
    spec, why = celeris_accepts(schema, vocab)
    assert spec is not None, why


def test_the_grammar_never_accepts_an_invalid_instance_and_accepts_valid_ones(vocab: Any) -> None:
    """Every invalid instance of the benchmark is refused by Celeris's grammar; valid ones are accepted where
    they are written as the grammar writes JSON (closed objects, keys in declared order: a narrower grammar
    may refuse a valid instance, never accept an invalid one)."""
    invalid = valid = held = 0
    for path in FILES:
        schema, tests = _read(path)
        spec, _ = celeris_accepts(schema, vocab)
        if spec is None:
            continue
        for instance, ok in tests:
            accepted = holds(spec, instance, vocab)
            if not ok:
                invalid += 1
                assert not accepted, (path.name, instance)
            else:
                valid += 1
                held += accepted
                if accepted:  # the oracle agrees with the grammar
                    jsonschema.validate(instance, schema)
    assert invalid >= 40 and valid >= 40 and held >= valid // 2, (invalid, valid, held)


@pytest.fixture(scope="module")
def block() -> Engine:
    return load_engine("celeris-block", device="cpu", dtype="float32")


def test_every_stop_answer_over_the_sample_validates(block: Engine) -> None:
    """The property: over every schema of the sample Celeris accepts, each answer the embedded model finishes
    `stop` validates against the schema as given, and no answer was stopped by the final check (the grammar
    alone never completed an invalid answer)."""
    vocab = block.vocabulary()
    rows: list[tuple[str, Any, str, Any, int]] = []  # (file, schema, prompt, settings, seed)
    for path in FILES:
        schema, _ = _read(path)
        if celeris_accepts(schema, vocab)[0] is None:
            continue
        params = block.params({"structured_outputs": {"json": schema}, "gen_length": 32})
        for seed, prompt in enumerate(["Return a JSON value:", "Fill it in."]):
            rows.append((path.name, schema, prompt, block.params_for(prompt, params), seed))
    # every schema's rows in one running set (each answer is its answer alone: half the time of one per schema)
    prompts = [prompt for _, _, prompt, _, _ in rows]
    results = block.decode_running(
        prompts, [block.encode_prompt(p) for p in prompts], [r[3] for r in rows], [r[4] for r in rows], 16
    )
    stops = 0
    for (name, schema, _, _, _), r in zip(rows, results):
        assert r.error is None or "does not validate" not in r.error, (name, r.text, r.error)
        if r.finish_reason == "stop":
            stops += 1
            jsonschema.validate(json.loads(r.text), schema)
    assert stops >= 6, stops


def test_bench_suite_prints_coverage_per_subset_beside_llguidance(tmp_path: Path) -> None:
    out = tmp_path / "cov.json"
    r = CliRunner().invoke(app, ["bench", "structured", "--suite", str(SAMPLE), "--out", str(out)], terminal_width=200)
    assert r.exit_code == 0, r.output
    report = json.loads(out.read_text())
    assert len(report["subsets"]) == 10 and report["total"]["schemas"] == 42
    for name, row in report["subsets"].items():
        assert row["celeris"] >= row["llguidance"] - row["only_celeris"] and row["only_llguidance"] == 0, name
        assert row["invalid_held"] == 0, name
        assert name in r.stdout
    assert "llguidance alone" in r.stdout


def test_bench_suite_refuses_a_missing_folder(tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["bench", "structured", "--suite", str(tmp_path / "nope")])
    assert r.exit_code != 0 and "--suite" in r.output and "Traceback" not in r.output
