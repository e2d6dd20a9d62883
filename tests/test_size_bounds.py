"""Every size-like setting a user gives is bounded before anything is sized by it, in `params` itself, so
the server, the queue's request lines and `celeris batch` refuse the same values the same way: a
`max_tokens` of 10^9 once built a list entry per block of its canvas and grew a server to 22.7 GB before
the context check could refuse it. (The server's own test is in test_serve_hostile.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from celeris_cli.errors import UsageError
from celeris_cli.params import MAX_SIZE, GenerationParams, check_values
from celeris_cli.spool.backend import Preparer
from celeris_cli.spool.formats import parse_file

from .test_batch import celeris

SIZES = ["gen_length", "block_length", "denoise_steps", "block_steps", "top_k", "min_tokens", "suffix_window"]
SIZES += ["max_post_edit_steps"]


@pytest.mark.parametrize("key", SIZES)
def test_a_size_over_the_ceiling_is_refused_by_name_before_any_work(key: str) -> None:
    with pytest.raises(UsageError, match=f"^{key} must be .*{MAX_SIZE}"):
        GenerationParams.from_mapping({key: 10**9})  # (gen_length's once built 31 million blocks first)
    check_values({key: MAX_SIZE})  # the ceiling itself is a value


def test_the_longest_canvas_in_one_token_blocks_is_settled_without_listing_them() -> None:
    params = GenerationParams.from_mapping({"gen_length": MAX_SIZE, "block_length": 1, "denoise_steps": 1})
    assert params.denoise_steps == MAX_SIZE  # raised to one step per block, counted, not listed


def test_a_huge_integer_is_named_not_echoed() -> None:
    with pytest.raises(UsageError) as e:
        GenerationParams.from_mapping({"seed": 7 * 10**5000})
    assert str(e.value).startswith("seed must be") and str(e.value).endswith("an integer of about 5001 digits")
    with pytest.raises(UsageError, match="at most 1000 characters"):
        GenerationParams.from_mapping({"stop": ["x" * 1001]})


def test_a_queue_request_line_with_a_billion_max_tokens_is_a_bad_param(tiny_model: Path) -> None:
    line = {"custom_id": "big", "method": "POST", "url": "/v1/completions"}
    line["body"] = {"prompt": "x", "max_tokens": 10**9}  # type: ignore[assignment]
    requests, errors = parse_file("in.jsonl", (json.dumps(line) + "\n").encode(), 1 << 20)
    assert not errors
    with pytest.raises(UsageError, match="gen_length must be a positive integer, at most"):
        Preparer.load(str(tiny_model), {}).prepare(requests[0])


def test_celeris_batch_answers_a_billion_token_canvas_with_a_failure_record(tmp_path: Path, tiny_model: Path) -> None:
    lines = [{"id": "big", "prompt": "x", "gen_length": 10**9}, {"id": "ok", "prompt": "The quick", "gen_length": 4}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    out = tmp_path / "out.jsonl"
    p = celeris("batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(out), "--model", str(tiny_model),
                "--device", "cpu", "--set", '{"denoise_steps": 4}')  # fmt: skip
    assert p.returncode == 1, p.stderr  # one request failed, and said why
    assert [json.loads(x)["custom_id"] for x in out.read_text(encoding="utf-8").splitlines()] == ["ok"]
    (fail,) = map(json.loads, (tmp_path / "out.jsonl.failed.jsonl").read_text(encoding="utf-8").splitlines())
    assert fail["custom_id"] == "big" and fail["code"] == "bad_param" and "at most" in fail["message"]
