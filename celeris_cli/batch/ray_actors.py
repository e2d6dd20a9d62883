"""The queue's batches on a pool of Ray actors (`engine: {ray: ...}` in configs/batch.yaml): one batch in
flight per actor, each handed back to the daemon as soon as it is done.

The daemon keeps everything that makes the queue safe (claims, journals, publishing, the lock) and
prepares requests itself, with the tokenizer alone; each actor loads the engine once and only decodes.
An actor that dies (killed, out of memory) is restarted by Ray, which redoes its batch, at most `REDO`
times; per-request seeds make the redone rows identical. A batch that raises comes back as its exception, which
the daemon bisects and records exactly as in-process. Plain actors, not Ray Data: a daemon submits
batches as files arrive, and must know when each one is done.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CelerisError, ConfigError, ModelError
from ..spool.backend import Prepared, Preparer
from ..spool.batching import RequestTimeout
from ..spool.config import BatchConfig, RaySettings
from ..spool.formats import Request
from ..spool.pool import Done
from .ray_pool import CRASH_ENV, import_ray, init_ray, stdout_to_stderr

log = logging.getLogger(__name__)

REDO = 3  # a batch whose actor died this many times more comes back as ActorLost (then it is bisected)
POLL_S = 0.5  # ray.wait's longest sleep: signals are handled between two waits
REPLACE_TIMEOUT_S = 600.0  # the longest wait for a replacement actor to load its model


class ActorLost(CelerisError):
    """An actor died each time it ran this batch (a request that crashes the process, or a sick node)."""

    code = "actor_lost"
    retryable = True


@dataclass
class _Task:
    ticket: int
    batch: list[Prepared]
    actor: Any
    started: float


class RayActorPool:
    """A `spool.pool.Pool` over Ray actors."""

    def __init__(self, cfg: BatchConfig, actor_class: type | None = None) -> None:
        """`actor_class`: EngineActor, or a subclass (tests put a fake at the model boundary)."""
        settings = cfg.engine.ray
        assert settings is not None
        self.ray = import_ray("engine.ray", data=False)
        self.preparer = Preparer.load(cfg.model, cfg.generation)  # a bad model or settings fail before Ray
        self.timeout_s = cfg.request_timeout_s
        self.tickets = itertools.count(1)
        self.running: dict[Any, _Task] = {}  # ObjectRef -> its task
        self.stack = ExitStack()
        self.stack.enter_context(stdout_to_stderr())  # Ray's raylet writes to the driver's stdout
        self.actors: list[Any] = []
        try:
            if init_ray(self.ray, settings.address):
                self.stack.callback(self.ray.shutdown)
            self.actors = self._start(cfg, settings, actor_class or EngineActor)
        except BaseException:
            self.close()
            raise
        self.idle = list(self.actors)
        self.slots = len(self.actors)

    def _start(self, cfg: BatchConfig, s: RaySettings, actor_class: type) -> list[Any]:
        ray = self.ray
        total = ray.cluster_resources()
        cpus = s.cpus_per_actor if s.cpus_per_actor is not None else min(1.0, total.get("CPU", 1.0) / s.actors)
        for need, what in ((cpus, "CPU"), (s.gpus_per_actor, "GPU")):
            have = total.get(what, 0.0)
            if need > have:
                raise ConfigError(f"engine.ray: an actor needs {need:g} {what}s; the Ray cluster has {have:g}")
        threads = cfg.threads or max(1, int(total.get("CPU", 1.0) // s.actors))
        actor = ray.remote(actor_class).options(
            num_cpus=cpus, num_gpus=s.gpus_per_actor, max_restarts=-1, max_task_retries=REDO
        )
        args = (cfg.model, cfg.device, cfg.dtype, threads, cfg.generation, os.environ.get(CRASH_ENV), cfg.cuda_graphs)
        self.new_actor = lambda: actor.remote(*args)
        actors = [self.new_actor() for _ in range(s.actors)]
        try:
            ray.get([a.ready.remote() for a in actors])
        except ray.exceptions.RayError as e:
            raise ModelError(f"engine.ray: an actor could not load the engine: {_cause(e)}") from None
        log.info("%d Ray actors ready, %g CPUs and %g GPUs each, %d threads", s.actors, cpus, s.gpus_per_actor, threads)
        return actors

    def prepare(self, request: Request) -> Prepared:
        return self.preparer.prepare(request)

    def submit(self, batch: list[Prepared]) -> int:
        task = _Task(next(self.tickets), batch, self.idle.pop(0), time.monotonic())
        self.running[task.actor.run.remote(batch)] = task
        return task.ticket

    def wait(self) -> list[Done]:
        while True:
            refs = list(self.running)
            ready, _ = self.ray.wait(refs, num_returns=1, timeout=self._poll_s())
            if ready:
                ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
            done = [self._collect(ref) for ref in ready]
            done += self._expire()
            if done:
                return done

    def _collect(self, ref: Any) -> Done:
        ray, task = self.ray, self.running.pop(ref)
        try:
            bodies = ray.get(ref)
        except ray.exceptions.RayActorError as e:  # Ray restarted it and redid the batch REDO times already
            self._replace(task.actor)
            return Done(task.ticket, error=ActorLost(f"its actor died each of the {REDO + 1} times: {_cause(e)}"))
        except ray.exceptions.RayTaskError as e:  # the batch raised: hand back what it raised
            self.idle.append(task.actor)
            cause = getattr(e, "cause", None)
            return Done(task.ticket, error=cause if isinstance(cause, BaseException) else e)
        self.idle.append(task.actor)
        return Done(task.ticket, bodies=bodies)

    def _expire(self) -> list[Done]:
        """Batches past request_timeout_s, as SIGALRM interrupts the in-process engine: their actor is
        killed for good (Ray would redo the batch on a restarted one) and a new one takes its place."""
        if not self.timeout_s:
            return []
        now, out = time.monotonic(), []
        for ref, task in list(self.running.items()):
            # a batch that finished in time (while the daemon was busy, say loading a replacement actor)
            # is collected by the next wait, not timed out
            if now - task.started > self.timeout_s and not self.ray.wait([ref], timeout=0)[0]:
                del self.running[ref]
                self._replace(task.actor)
                late = RequestTimeout(f"ran past request_timeout_s ({self.timeout_s:g} s)")
                out.append(Done(task.ticket, error=late))
        return out

    def _replace(self, actor: Any) -> None:
        """A new actor, loaded, in the place of one that is killed for good: one that ran past the timeout
        (Ray would redo its batch on a restart), or one that died each time (still restarting now, so a
        batch sent to it at once would fail too, and count against an innocent request)."""
        self._drop(actor)
        self.actors.remove(actor)
        fresh = self.new_actor()
        try:  # its model load must not count as a batch's time
            self.ray.get(fresh.ready.remote(), timeout=REPLACE_TIMEOUT_S)
        except Exception as e:  # the cluster cannot give us an actor now: go on with fewer
            log.warning("a replacement actor did not start (%s); %d left", _cause(e), len(self.actors))
            self._drop(fresh)
            if not self.actors:
                raise ModelError(f"no Ray actor left to run batches: {_cause(e)}") from None
            return
        self.actors.append(fresh)
        self.idle.append(fresh)

    def _drop(self, actor: Any) -> None:
        try:
            self.ray.kill(actor, no_restart=True)
        except Exception:  # already gone
            pass

    def _poll_s(self) -> float:
        if not self.timeout_s or not self.running:
            return POLL_S
        oldest = min(t.started for t in self.running.values())
        return max(0.01, min(POLL_S, oldest + self.timeout_s - time.monotonic()))

    def close(self) -> None:
        for actor in self.actors:
            try:
                self.ray.kill(actor)
            except Exception:  # already gone with its session
                pass
        self.actors = []
        self.stack.close()  # shuts down a Ray started here, then gives stdout back


class EngineActor:
    """One Ray actor: loads the engine once, then decodes the batches it is given."""

    def __init__(
        self,
        model: str | None,
        device: str,
        dtype: str,
        threads: int,
        generation: dict[str, Any],
        crash_marker: str | None = None,
        cuda_graphs: str = "auto",
    ) -> None:
        from ..spool.backend import EngineBackend

        self.backend = EngineBackend(model, device, dtype, threads, generation, cuda_graphs=cuda_graphs)
        self.crash_marker = crash_marker  # tests: die at the second batch, once (the marker file remembers)
        self.batches_done = 0

    def ready(self) -> str:
        return str(self.backend.engine.device)

    def run(self, batch: list[Prepared]) -> list[dict[str, Any]]:
        if self.crash_marker and self.batches_done >= 1 and not Path(self.crash_marker).exists():
            Path(self.crash_marker).touch()
            os._exit(1)  # as if the node lost the process mid-batch
        self.batches_done += 1
        return self.backend.run(batch)


def _cause(e: BaseException) -> str:
    """The last line of a Ray error, which names the original exception."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[-1] if lines else type(e).__name__
