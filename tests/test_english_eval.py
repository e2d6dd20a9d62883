"""English figures of `celeris eval` on hand-made answers; the tuning split apart from the eval split."""

from __future__ import annotations

import pytest

from celeris_cli.engine import Engine
from celeris_cli.measure.evaluate import SPLITS, english_quality, repetitive, word_distinct_2


def test_word_distinct_2_pools_bigrams_over_answers_but_never_across_them() -> None:
    # "the cat sat" -> (the cat) (cat sat); "The cat, ran" -> (the cat) (cat ran): 3 unique of 4
    assert word_distinct_2(["the cat sat", "The cat, ran"]) == pytest.approx(3 / 4)
    assert word_distinct_2(["sir sir sir sir sir"]) == pytest.approx(1 / 4)
    assert word_distinct_2(["cat", "sat"]) == 0.0  # no bigram within an answer, none across


def test_an_answer_repeats_itself_by_a_dominant_word_or_a_repeated_trigram() -> None:
    assert repetitive("my lord, sir, my lord, and so, sir, my lord")  # "my lord" + next word recur
    assert repetitive("sir, thou art a man, sir, and he is good, sir, I say sir now")  # sir is 4 of 14
    assert not repetitive("the cat sat on a mat and the dog lay by the door all day long")  # the: 3 of 16
    assert repetitive("the cat sat on the mat and the dog lay by the door all day long")  # the: 4 of 16
    assert not repetitive("the the cat")  # short: a word may be a large share; no trigram repeats
    assert repetitive("a b c a b c")
    assert not repetitive("")


def test_english_quality_counts_empty_answers_and_words() -> None:
    q = english_quality(["", ", .", "one two three", "sir sir sir sir sir sir"])
    assert q["empty_rate"] == pytest.approx(2 / 4)
    assert q["mean_words"] == pytest.approx((0 + 0 + 3 + 6) / 4)
    assert q["repetition_rate"] == pytest.approx(1 / 4)
    assert q["distinct_2"] == pytest.approx(3 / 7)  # (one two) (two three) + sir sir x5


def test_the_tuning_split_never_overlaps_the_eval_split() -> None:
    (ep, ee), (tp, te) = SPLITS["eval"], SPLITS["tune"]
    rows = list(range(300))
    assert set(rows[ep]).isdisjoint(rows[tp]) and set(rows[ee]).isdisjoint(rows[te])
    assert ep.stop <= tp.start and ee.stop <= te.start


def test_eval_reports_english_figures_and_a_human_reference(engine: Engine) -> None:
    from celeris_cli.measure.evaluate import EvalSet, evaluate

    params = engine.params({"gen_length": 8, "block_length": 8, "denoise_steps": 8})
    r = evaluate(engine, params, EvalSet.load(), poems=1, english=3, batch_size=4, nll=False, split="tune")
    for key in ("english_distinct_2", "english_repetition_rate", "english_empty_rate", "english_mean_words"):
        assert key in r and key in r["human_reference"]
    assert r["human_reference"]["english_empty_rate"] == 0.0 and r["human_reference"]["english_mean_words"] > 0
    assert r["english_prompts"] == 3 and r["split"] == "tune"
