"""Task caching keyed on a stage's inputs and the task's source, with content-addressed output folders.

A cacheable stage writes into ``runs/<stage>/<key>/`` where ``key`` hashes what determines its output (the data
md5 or the parent's content hash, the stage's resolved config, the ``evoharness`` library's source). The Prefect
cache key is that key plus the task's source (``TASK_SOURCE``) plus the folder's epoch: a random id written into
``<folder>/.cache-epoch`` when the folder is first keyed. A deleted folder gets a new epoch, so its output is
rebuilt rather than served from a stale cache record; a run that failed stored no record, so its rerun resumes
in the same folder.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path

from prefect.cache_policies import TASK_SOURCE, CacheKeyFnPolicy


def library_digest() -> str:
    """sha256 of the ``evoharness`` library's source: a stage's output depends on the library code, not only on
    its Prefect task's source, so any library change gives new output folders and cache keys."""
    root = Path(__file__).resolve().parent.parent / "evoharness"
    h = hashlib.sha256()
    for path in sorted(root.glob("*.py")):
        h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()


def content_key(*parts) -> str:
    """16 hex chars of sha256 over the JSON of ``parts`` (dataclasses as dicts) and the library's source."""
    blob = json.dumps([library_digest(), *parts], sort_keys=True, default=lambda o: getattr(o, "__dict__", str(o)))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def stage_policy(out_dir_fn):
    """A cache policy for a task whose output folder is ``out_dir_fn(parameters)``."""

    def key(_ctx, parameters: dict) -> str:
        out = Path(out_dir_fn(parameters))
        out.mkdir(parents=True, exist_ok=True)
        epoch = out / ".cache-epoch"
        if not epoch.exists():
            epoch.write_text(uuid.uuid4().hex)
        return content_key(str(out), epoch.read_text())

    return TASK_SOURCE + CacheKeyFnPolicy(cache_key_fn=key)


def run_stage(task, *args, **kwargs) -> tuple[object, bool]:
    """Call a Prefect task; return (its result, whether Prefect served it from the cache)."""
    state = task(*args, return_state=True, **kwargs)
    return state.result(), state.name == "Cached"


def transient_only(_task, _task_run, state) -> bool:
    """Prefect ``retry_condition_fn``: retry crashes and flaky failures, never deterministic input errors (a missing
    split or game, a bad record, a data-version mismatch, a bad config), which would fail the same way again."""
    from evoharness.datastore import DataVersionMismatch
    from evoharness.rawlog import RawLogError

    try:
        state.result()
    except (FileNotFoundError, ValueError, RawLogError, DataVersionMismatch, KeyError, TypeError):
        return False
    except Exception:
        return True
    return True


# The retry policy of every flaky stage: two retries with backoff, transient failures only.
RETRY = {"retries": 2, "retry_delay_seconds": [10, 60], "retry_condition_fn": transient_only}
