"""What the journal makes of how earlier claims ended (issue 46 item 1): only a death while a suspect
was tested alone is evidence against it; a stop or a machine restart is evidence against nothing, and an
ordinary batch's death only makes its rows suspects."""

from __future__ import annotations

from pathlib import Path

from celeris_cli.spool.journal import Journal, JournalState


def claims(tmp_path: Path, *ends: list[dict[str, object]], boot: str = "boot-1") -> JournalState:
    """A journal whose first claim wrote `ends[0]`, each resumed claim (on `boot` unless its records say)
    `ends[i]`; then the resume of the next claim, on `boot`."""
    journal = Journal(tmp_path / "journal" / "00000001.jsonl")
    for i, records in enumerate(ends):
        if i:
            journal.resume(boot=boot)
        for rec in records:
            journal.append(rec)
    return journal.resume(boot=boot)


def test_a_death_during_an_ordinary_batch_makes_suspects_and_no_evidence(tmp_path: Path) -> None:
    st = claims(tmp_path, [{"try": [1, 2, 3]}, {"outcomes": [{"line": 1, "body": {}}]}])
    assert st.suspects == {2, 3} and st.evidence == {}


def test_each_death_while_a_suspect_is_tested_alone_is_one_piece_of_evidence(tmp_path: Path) -> None:
    st = claims(tmp_path, [{"try": [1, 2]}], [{"try": [2], "suspect": True}], [{"try": [2], "suspect": True}])
    assert st.evidence == {2: 2} and st.suspects == {1, 2}


def test_a_stop_is_no_evidence_and_keeps_the_suspects_it_found(tmp_path: Path) -> None:
    st = claims(
        tmp_path,
        [{"try": [1, 2]}],
        [{"try": [2], "suspect": True}, {"stopped": [2]}],
        [{"try": [1, 2]}, {"stopped": [1, 2]}],
    )
    assert st.evidence == {} and st.suspects == {1, 2}


def test_a_stop_of_an_ordinary_claim_makes_no_suspects(tmp_path: Path) -> None:
    st = claims(tmp_path, [{"try": [1, 2, 3]}, {"stopped": [1, 2, 3]}], [{"try": [1, 2, 3]}, {"stopped": [1, 2]}])
    assert st.evidence == {} and st.suspects == set()


def test_a_machine_restart_is_no_evidence(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal" / "00000001.jsonl")
    journal.append({"try": [1, 2]})
    journal.resume(boot="before")
    journal.append({"try": [2], "suspect": True})  # the machine restarted while line 2 was tested
    st = journal.resume(boot="after")
    assert st.evidence == {} and st.suspects == {1, 2}
    journal.append({"try": [2], "suspect": True})  # then the process died on this boot
    st = journal.resume(boot="after")
    assert st.evidence == {2: 1}


def test_deaths_while_a_resumed_file_is_read_or_prepared_are_counted_in_a_row(tmp_path: Path) -> None:
    st = claims(tmp_path, [], [], [])  # the first claim may have been decoding (it journals nothing); then two
    assert st.idle_deaths == 2 and st.suspects is None  # resumed claims died before their requests were ready
    (tmp_path / "b").mkdir()
    st = claims(tmp_path / "b", [], [], [{"stopped": []}], [])
    assert st.idle_deaths == 2  # a stop neither counts nor breaks the row


def test_a_resumed_file_that_was_waiting_for_its_turn_at_a_death_is_not_blamed(tmp_path: Path) -> None:
    waiting = [{"prepared": True}]  # read and prepared; none of its lines in flight when the process died
    st = claims(tmp_path, [{"try": [1, 2]}], waiting, waiting, waiting, waiting, waiting, waiting)
    assert st.idle_deaths == 0 and st.evidence == {} and st.suspects == {1, 2}


def test_the_rows_a_death_had_in_flight_are_one_group_tested_together(tmp_path: Path) -> None:
    """An ordinary kill costs the batch in flight decoded again, together, not row by row."""
    done = [{"line": n, "body": {}} for n in range(1, 9)]
    st = claims(
        tmp_path, [{"try": list(range(1, 9))}], [{"try": list(range(1, 9)), "suspect": True}, {"outcomes": done}]
    )
    assert st.groups == [] and st.suspects == set()  # the group's test passed: decided, nothing to test
    (tmp_path / "b").mkdir()
    st = claims(tmp_path / "b", [{"try": [1, 2, 3]}, {"try": [4, 5]}])
    assert st.groups == [{1, 2, 3, 4, 5}] and st.evidence == {}


def test_a_death_during_a_groups_test_halves_it_down_to_one_row_and_only_that_is_evidence(tmp_path: Path) -> None:
    st = claims(tmp_path, [{"try": [1, 2, 3, 4, 5]}], [{"try": [1, 2, 3, 4, 5], "suspect": True}])
    assert st.groups == [{1, 2}, {3, 4, 5}] and st.evidence == {}
    (tmp_path / "b").mkdir()
    ok = {"outcomes": [{"line": 1, "body": {}}, {"line": 2, "body": {}}]}
    st = claims(
        tmp_path / "b",
        [{"try": [1, 2, 3, 4]}],
        [{"try": [1, 2], "suspect": True}, ok, {"try": [3, 4], "suspect": True}],  # [1, 2] passed; [3, 4] died
        [{"try": [3], "suspect": True}],  # row 3 alone died
    )
    assert st.groups == [{3}, {4}] and st.evidence == {3: 1} and st.suspects == {3, 4}
