"""Running requests on a Ray actor pool with Ray Data, the way vLLM's and Ray's own offline LLM inference
do: each actor loads the engine once and maps batches of request rows to outcome rows.

A request's failure is data (an outcome row with its code), never a raised exception: Ray drops whole
blocks when user code raises (`max_errored_blocks`), and it does not retry user exceptions. A killed actor
is restarted and its batch redone; per-request seeds make a redone row identical to its first run.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..spool.formats import Request
from . import Outcome

log = logging.getLogger(__name__)

# fault injection for tests: a worker that has finished a batch dies at its next one, once (the marker file
# remembers), so finished work of that actor has been handed back before the crash
CRASH_ENV = "CELERIS_RAY_CRASH_ONCE"


@dataclass(frozen=True, kw_only=True)
class RayOptions:
    address: str | None = None  # None: a local Ray for this run; "auto" or "ray://host:10001": a cluster
    actors: int = 1
    cpus_per_actor: float | None = None  # None: what leaves room for Ray Data's own read task
    gpus_per_actor: float = 0.0
    threads_per_actor: int | None = None  # torch threads; None: the cluster's CPUs shared among the actors
    batch_size: int = 16
    token_budget: int = 16384
    engine: dict[str, Any] = field(default_factory=dict)  # model, device, dtype, cuda_graphs, generation


def import_ray(what: str = "--ray", data: bool = True) -> Any:
    try:
        import ray

        if data:
            import ray.data  # noqa: F401
    except ImportError:
        raise UsageError(  # Celeris is on no package index: install its ray extra from a clone or a wheel
            f"{what} needs Ray: pip install -e '.[ray]' in a clone of Celeris "
            "(or pip install 'celeris-VERSION-py3-none-any.whl[ray]' from a built wheel)"
        ) from None
    return ray


def init_ray(ray: Any, address: str | None) -> bool:
    """Join Ray at `address`, or start a local one (None); returns whether this process started the
    session (and so shuts it down). Actors get this process's CELERIS_* variables (fault injection)."""
    if ray.is_initialized():
        return False
    try:
        ray.init(
            address=address,
            log_to_driver=False,  # stdout belongs to the results, stderr to our own progress
            logging_level=logging.WARNING,
            include_dashboard=False,
            runtime_env={"env_vars": {k: v for k, v in os.environ.items() if k.startswith("CELERIS_")}},
        )
    except (ConnectionError, RuntimeError, ValueError) as e:
        where = address or "a local Ray"
        raise UsageError(f"cannot start or join Ray ({where}): {str(e).splitlines()[0]}") from None
    return True


def check_engine(engine: dict[str, Any]) -> None:
    """What each actor will load, checked on the driver first: a missing model folder or a settings
    combination the model's defaults reject is one clear error here, not a retried actor crash there."""
    from ..arch.folder import ModelFolder
    from ..engine import model_dir

    ModelFolder.open(model_dir(engine.get("model"))).check(engine.get("generation", {}))


class RayExecutor:
    def __init__(self, options: RayOptions) -> None:
        self.options = options
        self.ray = import_ray()
        check_engine(options.engine)

    def run(self, requests: list[Request], done: frozenset[int] = frozenset()) -> Iterator[list[Outcome]]:
        with stdout_to_stderr():
            yield from self._session(requests, done)

    def _session(self, requests: list[Request], done: frozenset[int]) -> Iterator[list[Outcome]]:
        started_here = init_ray(self.ray, self.options.address)
        try:
            yield from self._run(requests, done)
        finally:
            if started_here:
                self.ray.shutdown()

    def _run(self, requests: list[Request], done: frozenset[int]) -> Iterator[list[Outcome]]:
        ray, o = self.ray, self.options
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ctx.print_on_execution_start = False
        total_cpus = float(ray.cluster_resources().get("CPU", 1))
        # the reservation leaves room for Ray Data's read task (a full CPU per actor on a 2-CPU machine
        # starves it and the job hangs); the threads use what the actors share
        cpus = o.cpus_per_actor if o.cpus_per_actor is not None else min(1.0, total_cpus / (o.actors + 1))
        threads = o.threads_per_actor or max(1, int(total_cpus // o.actors))
        # the driver packs, as the local executor does, and each Ray row is one whole batch, which the actor
        # decodes as one running set of batch_size rows (locally, the next batches' rows join as rows leave)
        from ..spool.backend import Preparer
        from .local import prepare_and_pack, skip_done

        preparer = Preparer.load(o.engine.get("model"), o.engine.get("generation", {}))
        batches, failed = prepare_and_pack(preparer.prepare, requests, o.batch_size, o.token_budget)
        failed, batches = skip_done(failed, batches, done)
        if failed:
            yield failed
        if not batches:
            return
        by_line = {r.line: r for r in requests}
        gather = BatchGather(batches)
        rows = [{"batch": json.dumps([asdict(p.request) for p in b], ensure_ascii=False)} for b in batches]
        out = ray.data.from_items(rows).map_batches(
            RayWorker,
            fn_constructor_kwargs={"engine": o.engine, "threads": threads, "batch_size": o.batch_size},
            batch_size=1,
            compute=ray.data.ActorPoolStrategy(size=o.actors),
            num_cpus=cpus,
            num_gpus=o.gpus_per_actor,
        )  # Ray Data restarts a dead pool actor and retries its task by default (max_restarts=-1); tested
        for row in out.iter_rows():
            rec = json.loads(row["outcome"])
            finished = gather.add(Outcome(by_line[rec.pop("line")], **rec))
            if finished:
                yield finished  # the driver journals each batch once all its rows are back


class BatchGather:
    """Rows come back one by one, batches interleaved; the driver's journal takes whole batches, as the
    local run's does, so rows are held until every row of their packed batch has arrived."""

    def __init__(self, batches: list[list[Any]]) -> None:
        self.batch_of = {p.request.line: i for i, b in enumerate(batches) for p in b}
        self.size = [len(b) for b in batches]
        self.rows: dict[int, list[Outcome]] = {}

    def add(self, oc: Outcome) -> list[Outcome] | None:
        i = self.batch_of[oc.request.line]
        rows = self.rows.setdefault(i, [])
        rows.append(oc)
        return self.rows.pop(i) if len(rows) == self.size[i] else None


@contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Ray's raylet prints retries and worker deaths to the driver's stdout even with log_to_driver off;
    stdout belongs to the results, so file descriptor 1 points at stderr while Ray runs."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


class RayWorker:
    """One actor: loads the engine once, then turns batches of request rows into outcome rows."""

    def __init__(self, engine: dict[str, Any], threads: int, batch_size: int = 16) -> None:
        from ..spool.backend import EngineBackend
        from .local import LocalExecutor

        backend = EngineBackend(
            engine.get("model"), engine.get("device", "auto"), engine.get("dtype", "auto"), threads,
            engine.get("generation", {}), cuda_graphs=engine.get("cuda_graphs", "auto"),
        )  # fmt: skip
        self.executor = LocalExecutor(backend, batch_size)  # the running set as wide as --batch-size
        self.batches_done = 0

    def __call__(self, rows: dict[str, Any]) -> dict[str, list[str]]:
        """Each row is one batch packed by the driver, decoded as it is."""
        marker = os.environ.get(CRASH_ENV)
        if marker and self.batches_done >= 1 and not Path(marker).exists():
            Path(marker).touch()
            os._exit(1)  # as if the node lost the process mid-batch
        self.batches_done += 1
        outcomes = []
        for row in rows["batch"]:
            outcomes += [self._row(oc) for oc in self._decode([Request(**r) for r in json.loads(row)])]
        return {"outcome": outcomes}

    def _decode(self, requests: list[Request]) -> Iterator[Outcome]:
        """The driver's batch as one batch: the same requests re-prepared here (a failure would be this
        actor's own) fall in one group, already in cost order, so packing them again cannot split them."""
        from .local import prepare_and_pack

        batches, failed = prepare_and_pack(self.executor.pool.prepare, requests, len(requests), 1 << 62)
        yield from failed
        for outcomes in self.executor.decode(batches):
            yield from outcomes

    @staticmethod
    def _row(oc: Outcome) -> str:
        rec = {"line": oc.request.line, "body": oc.body, "code": oc.code, "message": oc.message,
               "retryable": oc.retryable}  # fmt: skip
        return json.dumps(rec, ensure_ascii=False)
