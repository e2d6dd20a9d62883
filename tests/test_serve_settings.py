"""Who may call `celeris serve`, and where it may listen: keys and exposure, without a server."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from celeris_cli.errors import UsageError
from celeris_cli.serve.settings import Keys, check_exposure, is_loopback

from .serve_helpers import celeris


def test_keys_from_a_file_accept_each_of_its_keys_as_a_bearer_token_only(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("sk-old\n\n  sk-new  \n", encoding="utf-8")
    keys = Keys.from_file(path)
    assert keys.accepts("Bearer sk-old") and keys.accepts("bearer sk-new")
    for wrong in (None, "", "Bearer", "Bearer sk-ol", "Basic sk-old", "sk-old", "Bearer sk-old2"):
        assert not keys.accepts(wrong), wrong
    assert Keys().accepts(None)  # no key configured: no authentication


def test_an_empty_or_unreadable_key_file_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "empty").write_text("\n \n", encoding="utf-8")
    with pytest.raises(UsageError, match="holds no key"):
        Keys.from_file(tmp_path / "empty")
    with pytest.raises(UsageError, match="cannot read"):
        Keys.from_file(tmp_path / "missing")


def test_only_loopback_may_listen_without_a_key_unless_the_user_says_insecure() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.0.0.2")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5") and not is_loopback("myhost")
    check_exposure("127.0.0.1", Keys(), insecure_no_auth=False)
    with pytest.raises(UsageError, match="--api-key-file"):
        check_exposure("0.0.0.0", Keys(), insecure_no_auth=False)
    check_exposure("0.0.0.0", Keys(), insecure_no_auth=True)
    check_exposure("0.0.0.0", Keys((b"k",)), insecure_no_auth=False)
    with pytest.raises(UsageError, match="contradict"):
        check_exposure("127.0.0.1", Keys((b"k",)), insecure_no_auth=True)


def test_with_a_queue_the_model_comes_from_its_config(tmp_path: Path) -> None:
    from .spool_helpers import make_queue

    config = make_queue(tmp_path)
    r = celeris("serve", "--queue", str(config), "--model", "celeris-tiny", "--port", "1")
    assert r.returncode == 2 and r.stderr.startswith("Error: --model: with --queue") and r.stdout == ""


def test_the_default_threads_leave_a_cpu_to_the_http_side_or_follow_omp(monkeypatch: pytest.MonkeyPatch) -> None:
    from celeris_cli.cli.serve import default_threads

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_threads() is None  # torch reads it itself
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert default_threads() == 7
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert default_threads() == 1


def test_host_and_origin_names_allowed_beside_loopback() -> None:
    from celeris_cli.serve.guard import ANY_HOST, allowed_hosts, hostname

    assert allowed_hosts("myhost.lan") == {"myhost.lan"} and allowed_hosts("0.0.0.0") == {ANY_HOST}
    assert allowed_hosts("::") == {ANY_HOST} and allowed_hosts("[::1]") == {"::1"}
    assert [hostname(h) for h in ("[::1]:8000", "LocalHost:80", "127.0.0.1", "::1")] == [
        "::1",
        "localhost",
        "127.0.0.1",
        "::1",
    ]
