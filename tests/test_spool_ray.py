"""The queue on Ray (issue #16): `engine: {ray: ...}` sends the daemon's batches to a Ray actor pool, while
claims, journals, publishing and the lock stay in the daemon. Real Ray, the tiny test model; one Ray
session for the in-process tests of this module, and the daemon's own Ray for the crash test."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from celeris_cli.batch.ray_actors import EngineActor, RayActorPool
from celeris_cli.errors import ConfigError, UsageError
from celeris_cli.spool.backend import EngineBackend, Prepared
from celeris_cli.spool.config import RaySettings, load_config
from celeris_cli.spool.daemon import Spool

from .spool_helpers import claimed, drop, failures, make_queue, outputs
from .test_spool_process import REPO, accounted, celeris, wait_for

RAY = {"ray": {"actors": 2, "cpus_per_actor": 0.5}}
SLOW_START = {"RAY_gcs_server_port_wait_time_s": "120"}  # Ray's 30 s for its GCS to start is short on 2 busy cores
GEN = {"gen_length": 16, "block_length": 8, "denoise_steps": 8, "temperature": 1.0}  # sampled: seeds matter


# -- config: no Ray needed ------------------------------------------------------------------------------
def test_engine_ray_config_is_parsed_and_validated_by_key(tmp_path: Path) -> None:
    cfg = load_config(make_queue(tmp_path, engine={"ray": {"address": "auto", "actors": 3, "gpus_per_actor": 1}}))
    assert cfg.engine.ray == RaySettings(address="auto", actors=3, cpus_per_actor=None, gpus_per_actor=1)
    assert load_config(make_queue(tmp_path)).engine.ray is None  # no `engine:`: the in-process engine
    assert load_config(make_queue(tmp_path, engine={})).engine.ray is None
    bad = [
        (
            {"ray": {"actor": 2}},
            "engine.ray.actor: unknown key (known: address, actors, cpus_per_actor, gpus_per_actor)",
        ),
        ({"gpu": {}}, "engine.gpu: unknown key (known: ray)"),
        ({"ray": {"actors": 0}}, "engine.ray.actors: must be positive, got 0"),
        ({"ray": {"actors": True}}, "engine.ray.actors: must be int, got True"),
        ({"ray": {"cpus_per_actor": -1}}, "engine.ray.cpus_per_actor: must be positive or null, got -1"),
        ({"ray": ["auto"]}, "engine.ray: must be a mapping, got ['auto']"),
    ]
    for engine, message in bad:
        with pytest.raises(ConfigError) as e:
            load_config(make_queue(tmp_path, engine=engine))
        assert str(e.value) == message
    p = celeris("watch", str(make_queue(tmp_path, engine={"ray": {"actorz": 2}})), "--once")
    assert (
        p.returncode == 2
        and p.stderr.startswith("Error: engine.ray.actorz: unknown key")
        and "Traceback" not in p.stderr
    )


def test_engine_ray_without_ray_installed_says_how_to_install_it(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(UsageError, match=r"^engine.ray needs Ray: pip install -e '\.\[ray\]' in a clone"):
        RayActorPool(load_config(make_queue(tmp_path, model=tiny_model, engine=RAY)))


# -- on a real Ray ----------------------------------------------------------------------------------------
def explode_on(batch: list[Prepared]) -> None:
    """A decode that raises (an out-of-memory stand-in) for any batch holding an `explode` prompt."""
    if any("explode" in p.payload[0] for p in batch):
        raise RuntimeError("simulated out of memory")


class ExplodesOnAPrompt:
    """The model, except that a forward computing `prompt` (its ids in a row, in order) raises as
    `explode_on` does: a running set's forwards never see the batch, only the model sees the rows."""

    def __init__(self, model: Any, prompt: list[int]) -> None:
        self.model, self.prompt = model, prompt

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def hidden(self, ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        n = len(self.prompt)
        if any(row[i : i + n] == self.prompt for row in ids.tolist() for i in range(len(row) - n + 1)):
            raise RuntimeError("simulated out of memory")
        return self.model.hidden(ids, *args, **kwargs)


class ExplodingBackend(EngineBackend):
    """In process the rows decode in the engine's running set (`RunningPool`), which raises at the model
    for the explode prompt; each batch then decodes on its own (`run`), where the batch holding it raises."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.engine.model = ExplodesOnAPrompt(self.engine.model, self.engine.encode_prompt("explode here"))

    def run(self, batch: list[Prepared]) -> list[dict[str, Any]]:
        explode_on(batch)
        return super().run(batch)


class ExplodingActor(EngineActor):
    def run(self, batch: list[Prepared]) -> list[dict[str, Any]]:
        explode_on(batch)
        return super().run(batch)


def forget_earlier_ray_tokens(mp: pytest.MonkeyPatch) -> None:
    """An earlier Ray session in this process (any test's) left token auth on and its token cached;
    a new session would then skip writing a token to this HOME and its GCS would abort (`has_token`)."""
    for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        mp.delenv(key, raising=False)
    try:
        from ray._private.authentication_test_utils import reset_auth_token_state
    except ImportError:  # a Ray without token auth
        return
    reset_auth_token_state()


@pytest.fixture(scope="module")
def ray_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    ray = pytest.importorskip("ray")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(tmp_path_factory.mktemp("ray-home")))  # Ray 2.60 writes ~/.ray/auth_token
        for key, value in SLOW_START.items():
            mp.setenv(key, value)
        forget_earlier_ray_tokens(mp)
        ray.init(
            num_cpus=2,
            log_to_driver=False,
            include_dashboard=False,
            logging_level=logging.WARNING,
            runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}},  # actors import this module's ExplodingActor
        )
    yield ray
    ray.shutdown()


def fill(root: Path) -> set[str]:
    """Two files of sampled prompts, one poison line and one bad setting; returns every id."""
    drop(root, "a.txt", "".join(f"床前明月光 {i}\n" for i in range(10)) + "explode here\n", age_s=20)
    lines = [json.dumps({"id": f"b{i}", "prompt": f"To be {i}", "seed": i}) for i in range(9)]
    lines.append(json.dumps({"id": "bad", "prompt": "x", "min_p": 1.5}))
    drop(root, "b.jsonl", "\n".join(lines) + "\n", age_s=10)
    return {f"a.txt:line-{i}" for i in range(1, 12)} | {f"b.jsonl:b{i}" for i in range(9)} | {"b.jsonl:bad"}


def published(root: Path) -> tuple[dict[str, list[tuple[str, dict[str, Any]]]], list[tuple[Any, ...]]]:
    """Results without their timings, and failure records without their times: what must not depend on
    where the batches ran."""
    results = {
        name: [(r["custom_id"], {k: v for k, v in r["response"]["body"].items() if k != "timing"}) for r in recs]
        for name, recs in outputs(root).items()
    }
    fails = sorted(
        (f["source"]["file"], f["custom_id"], f["code"], f["message"], f["retryable"]) for f in failures(root)
    )
    return results, fails


@pytest.fixture(scope="module")
def local_run(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Any:
    root = tmp_path_factory.mktemp("local")
    ids = fill(root)
    cfg = load_config(make_queue(root, model=tiny_model, batch_size=4, generation=GEN))
    backend = ExplodingBackend(cfg.model, "cpu", "float32", 1, cfg.generation)
    assert Spool(cfg, lambda: backend).run(once=True) == 1  # the poison line and the bad setting failed
    assert sorted(accounted(root)) == sorted(ids)
    return published(root)


def events(root: Path) -> list[dict[str, Any]]:
    path = root / "logs" / "events.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(x) for x in lines if x.endswith("}")]  # a line being written is left for later


def test_queue_on_ray_publishes_what_the_in_process_engine_does_with_batches_in_flight_at_once(
    tmp_path: Path, tiny_model: Path, ray_session: Any, local_run: Any
) -> None:
    ids = fill(tmp_path)
    cfg = load_config(make_queue(tmp_path, model=tiny_model, batch_size=4, generation=GEN, engine=RAY))
    assert Spool(cfg, lambda: RayActorPool(cfg, ExplodingActor)).run(once=True) == 1
    assert sorted(accounted(tmp_path)) == sorted(ids) and claimed(tmp_path) == []
    results, fails = published(tmp_path)
    assert (results, fails) == local_run  # same texts, same failure records (the raising batch was bisected)
    assert [f[1:3] for f in fails] == [("line-11", "engine_error"), ("bad", "bad_param")]
    log = events(tmp_path)
    assert max(e["in_flight"] for e in log if e["event"] == "submit") == 2  # two batches out at once
    first_done = next(i for i, e in enumerate(log) if e["event"] in ("batch", "bisect"))
    assert sum(e["event"] == "submit" for e in log[:first_done]) == 2  # both started before either finished


def test_an_actor_killed_mid_run_still_gives_one_result_per_request(
    tmp_path: Path, tiny_model: Path, ray_session: Any, local_run: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "crashed"
    monkeypatch.setenv("CELERIS_RAY_CRASH_ONCE", str(marker))  # an actor exits at its second batch, once
    ids = fill(tmp_path)
    cfg = load_config(make_queue(tmp_path, model=tiny_model, batch_size=4, generation=GEN, engine=RAY))
    assert Spool(cfg, lambda: RayActorPool(cfg, ExplodingActor)).run(once=True) == 1
    assert marker.exists()  # an actor did die mid-batch; Ray restarted it and redid the batch
    bisected = [e["error"] for e in events(tmp_path) if e["event"] == "bisect"]
    assert bisected and all(error == "RuntimeError: simulated out of memory" for error in bisected)  # not the death
    assert sorted(accounted(tmp_path)) == sorted(ids)  # each id once: a result or a failure record
    assert published(tmp_path) == local_run  # the redone rows are the rows the first run would have given


class HangingActor(EngineActor):
    def run(self, batch: list[Prepared]) -> list[dict[str, Any]]:
        while any("hang" in p.payload[0] for p in batch):
            time.sleep(0.05)
        return super().run(batch)


def test_a_batch_past_request_timeout_s_on_ray_fails_as_in_process_and_its_actor_is_replaced(
    tmp_path: Path, tiny_model: Path, ray_session: Any
) -> None:
    drop(tmp_path, "h.txt", "a longer prompt, one\nhang\na longer prompt, three\na longer prompt, four\n")
    one_actor = {"ray": {"actors": 1, "cpus_per_actor": 0.5}}  # the shortest (hanging) request runs first on it
    cfg = load_config(
        make_queue(tmp_path, model=tiny_model, batch_size=1, generation=GEN, engine=one_actor, request_timeout_s=2)
    )
    assert Spool(cfg, lambda: RayActorPool(cfg, HangingActor)).run(once=True) == 1
    assert [e["failed"] for e in events(tmp_path) if e["event"] == "batch"] == [1, 0, 0, 0]  # the hang first
    # the rest ran on the actor that replaced the killed one
    assert [r["custom_id"] for r in outputs(tmp_path)["h.txt.results.jsonl"]] == ["line-1", "line-3", "line-4"]
    [rec] = failures(tmp_path)
    assert (rec["custom_id"], rec["code"], rec["retryable"]) == ("line-2", "timeout", False)
    assert rec["message"] == "ran past request_timeout_s (2 s)"  # the in-process message


class KillingActor(EngineActor):
    """A request that takes its actor's process down every time it runs (a segfault, an OOM kill)."""

    def run(self, batch: list[Prepared]) -> list[dict[str, Any]]:
        if any("die here" in p.payload[0] for p in batch):
            os._exit(1)
        return super().run(batch)


def test_a_request_that_kills_its_actor_every_time_fails_alone_as_actor_lost(
    tmp_path: Path, tiny_model: Path, ray_session: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray restarts the actor and redoes the batch REDO times; then the batch comes back as actor_lost and is
    halved like any failing batch, until the request at fault fails alone and its batch mates are served."""
    from celeris_cli.batch import ray_actors

    monkeypatch.setattr(ray_actors, "REDO", 0)  # one death per try keeps the test short
    drop(tmp_path, "k.txt", "a prompt, one\ndie here\na prompt, three\na prompt, four\n")
    cfg = load_config(make_queue(tmp_path, model=tiny_model, batch_size=2, generation=GEN, engine=RAY))
    assert Spool(cfg, lambda: RayActorPool(cfg, KillingActor)).run(once=True) == 1
    assert [r["custom_id"] for r in outputs(tmp_path)["k.txt.results.jsonl"]] == ["line-1", "line-3", "line-4"]
    [rec] = failures(tmp_path)
    assert (rec["custom_id"], rec["code"], rec["retryable"]) == ("line-2", "actor_lost", True)
    assert "its actor died each of the 1 times" in rec["message"]
    assert any(e["event"] == "bisect" for e in events(tmp_path))  # its batch mate was served after the halving


# -- the daemon killed while batches are out on Ray ------------------------------------------------------
def test_sigkill_of_the_daemon_mid_batch_on_ray_then_restart_loses_and_duplicates_nothing(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("ray")
    for key, value in SLOW_START.items():
        monkeypatch.setenv(key, value)  # for both daemons
    slow = {"gen_length": 32, "block_length": 32, "denoise_steps": 32}  # 15 batches of ~0.1 s: time to kill mid-run
    config = make_queue(tmp_path, model=tiny_model, batch_size=4, generation=slow, engine=RAY, rescan_s=60)
    ids = set()
    for f in range(3):
        drop(tmp_path, f"f{f}.txt", "".join(f"prompt {f}-{i}\n" for i in range(20)), age_s=30 - f)
        ids |= {f"f{f}.txt:line-{i}" for i in range(1, 21)}
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    daemon = subprocess.Popen(
        [sys.executable, "-m", "celeris_cli", "watch", str(config)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group: Ray's helpers that outlive it are cleaned up below
    )
    try:
        # two batches back (the first one's outcomes are journaled: an event is logged before its journal), and
        # a batch out on the actors: tried, with no outcome yet
        def mid_run() -> bool:
            if sum(e["event"] == "batch" for e in events(tmp_path)) < 2:
                return False
            tried, decided = _journaled(tmp_path)
            return bool(decided and tried - decided)

        wait_for(mid_run, timeout=120)
        daemon.send_signal(signal.SIGKILL)
        daemon.communicate(timeout=30)
    finally:
        try:
            os.killpg(daemon.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert daemon.returncode == -signal.SIGKILL
    tried, decided = _journaled(tmp_path)
    assert decided and tried - decided  # killed with batches done and batches still out on the actors
    again = celeris("watch", str(config), "--once", timeout=300)
    assert again.returncode == 0, again.stderr
    assert sorted(accounted(tmp_path)) == sorted(ids)  # 0 lost, 0 duplicated
    assert claimed(tmp_path) == [] and again.stdout == ""


def _journaled(tmp_path: Path) -> tuple[set[tuple[str, int]], set[tuple[str, int]]]:
    """The (journal, line) pairs the daemon has sent out (`try`) and those with an outcome, from its journals
    as they stand (a line being written as they are read is skipped)."""
    tried, decided = set(), set()
    for j in (tmp_path / "batch_inputs" / ".work" / "journal").glob("*.jsonl"):
        try:
            text = j.read_text()
        except FileNotFoundError:  # its file finished meanwhile
            continue
        for line in text.splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            tried |= {(j.name, n) for n in rec.get("try", [])}  # files take turns: key by file
            decided |= {(j.name, o["line"]) for o in rec.get("outcomes", [])}
    return tried, decided
