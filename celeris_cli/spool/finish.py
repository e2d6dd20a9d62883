"""Finishing a claimed file whose requests are all decided: serve lines appended to it meanwhile, wait
while a writer may still hold it, then publish; a publish the filesystem refuses (full disk, read-only or
unwritable folder) is retried later with back-off and never recorded as the requests' failure."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .batching import Item
from .formats import FileRejected, parse_file
from .fsutil import crashpoint, fsync_dir, sync_folder
from .intake import Job
from .ledger import failure_of_file
from .publish import line_failure

if TYPE_CHECKING:
    from .daemon import Spool

log = logging.getLogger(__name__)

BLOCKING_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS}
ONCE_PUBLISH_TRIES = 3  # --once gives up on a blocked publish after this many tries (exit 75)
MAX_BACKOFF_S = 60.0


def complete(spool: Spool, jobs: list[Job]) -> list[Item]:
    """Jobs with every request decided: returns new work for files that grew; publishes the others as
    one group (one folder fsync for all of them), or defers their publish."""
    work: list[Item] = []
    ready: list[Job] = []
    now = time.time()
    for job in jobs:
        try:
            st = os.stat(job.path)
        except FileNotFoundError:
            st = None  # removed by hand while claimed: publish what was decided
        if st is not None and st.st_size != job.read_len:
            data = job.path.read_bytes()
            if st.st_mtime > now - spool.cfg.settle_s and not data.endswith(b"\n") and b"\n" in data:
                data = data[: data.rindex(b"\n") + 1]  # a writer is mid-line
            if len(data) > job.read_len and hashlib.sha256(data[: job.read_len]).hexdigest() == job.digest:
                new = _appended(spool, job, data)
                if new:
                    work += new
                    continue
            elif len(data) != job.read_len:
                _changed(
                    spool, job, f"the file was rewritten after it was claimed ({job.read_len} -> {len(data)} bytes)"
                )
                job.read_len = len(data)
        if st is not None and now - st.st_mtime < spool.cfg.settle_s:
            job.not_before = st.st_mtime + spool.cfg.settle_s  # a writer may still hold it open
            continue
        ready.append(job)
    if ready:
        publish(spool, ready)
    return work


def _appended(spool: Spool, job: Job, data: bytes) -> list[Item]:
    """Lines appended to a claimed file are served too, their line ids continuing."""
    try:
        requests, errors = parse_file(job.name, data, spool.cfg.max_line_bytes)
    except FileRejected:
        requests, errors = [], []
    new = [r for r in requests if r.line > job.last_line]
    job.failures += [line_failure(job, e) for e in errors if e.line > job.last_line]
    job.requests += new
    job.read_len = len(data)
    job.digest = hashlib.sha256(data).hexdigest()
    job.last_line = data.count(b"\n")
    spool.events("grown", file=job.name, claim=job.seq, new_requests=len(new))
    return spool.prepare(job, new)


def _changed(spool: Spool, job: Job, message: str) -> None:
    job.failures.append(failure_of_file(job.name, job.seq, "changed_after_claim", message))


def publish(spool: Spool, jobs: list[Job]) -> None:
    """Results, then failure records, then inputs to processed/: each step durable, for the whole group,
    before the next."""
    pub = spool.publisher
    staged: dict[int, list[tuple[Path, Path]]] = {}
    for job in jobs:
        try:
            staged[job.seq] = pub.stage(job)
        except OSError as e:
            if e.errno not in BLOCKING_ERRNOS:
                raise
            _blocked(spool, job, e)
    written = [job for job in jobs if job.seq in staged]
    if not written:
        return
    temps = [tmp for pairs in staged.values() for tmp, _ in pairs]
    try:
        sync_folder(spool.f.outputs, temps)
    except OSError as e:
        if e.errno not in BLOCKING_ERRNOS:
            raise
        for tmp in temps:
            tmp.unlink(missing_ok=True)
        for job in written:
            _blocked(spool, job, e)
        return
    crashpoint("after_output_tmp")
    for pairs in staged.values():
        for tmp, final in pairs:
            os.replace(tmp, final)
    fsync_dir(spool.f.outputs)
    crashpoint("after_publish")
    counts = {}
    for job in list(written):
        try:
            counts[job.seq] = pub.records(job)
        except OSError as e:
            if e.errno not in BLOCKING_ERRNOS:
                raise
            _blocked(spool, job, e)
            written.remove(job)
    moved = [(job, pub.processed(job)) for job in written if job.path.exists()]
    fsync_dir(spool.f.processed)
    fsync_dir(spool.f.work)
    crashpoint("after_move")
    for job, dst in moved:
        if dst.stat().st_size != job.read_len:  # a writer still appending after the last check
            _changed(spool, job, "lines were appended after the results were published; resubmit them")
            counts[job.seq] = (counts[job.seq][0] + 1, counts[job.seq][1] + pub.records(job)[1])
    for job in written:
        job.journal.remove()
        spool.claimed.pop(job.seq, None)
        spool.inbox.release(job)
        failed, recorded = counts[job.seq]
        results = sum(1 for o in job.outcomes.values() if "body" in o)
        spool.done_this_run += results
        spool.failed_this_run += failed
        spool.files_this_run += 1
        codes = [r["code"] for r in job.failures] + [
            o["failure"]["code"] for o in job.outcomes.values() if "failure" in o
        ]
        spool.metrics.published(results, codes)
        spool.events(
            "published", file=job.name, claim=job.seq, results=results, failures=failed, new_failure_records=recorded
        )


def _blocked(spool: Spool, job: Job, e: OSError) -> None:
    for suffix in (".results.jsonl", ".results.txt"):  # no half-written temp file stays behind
        (spool.f.outputs / f".{job.name}{suffix}.tmp").unlink(missing_ok=True)
    job.blocked += 1
    delay = min(MAX_BACKOFF_S, spool.cfg.publish_retry_s * 2 ** (job.blocked - 1))
    job.not_before = time.time() + delay
    job.journal.append({"outcomes": list(job.outcomes.values())})  # a restart publishes without decoding
    code = errno.errorcode.get(e.errno or 0, str(e.errno))
    log.warning("cannot publish %s: %s (%s); retrying in %.1f s", job.name, e.strerror, code, delay)
    spool.events("publish_blocked", file=job.name, claim=job.seq, errno=code, message=str(e), retry_in_s=delay)
