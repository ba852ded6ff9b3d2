"""Task caching keyed on a stage's inputs and the task's source, with content-addressed output folders.

A cacheable stage writes into ``runs/<stage>/<key>/`` where ``key`` hashes what determines its output (the data
md5 or the parent's content hash, the stage's resolved config, the source of the library modules the stage runs). The
Prefect cache key is that key plus the task's source (``TASK_SOURCE``) plus the folder's epoch: a random id written into
``<folder>/.cache-epoch`` when the folder is first keyed. A deleted folder gets a new epoch, so its output is
rebuilt rather than served from a stale cache record; a run that failed stored no record, so its rerun resumes
in the same folder.
"""

from __future__ import annotations

import ast
import hashlib
import json
import uuid
from pathlib import Path

from prefect.cache_policies import TASK_SOURCE, CacheKeyFnPolicy

LIBRARY_ROOT = Path(__file__).resolve().parent.parent


def _module_file(name: str, root: Path) -> Path | None:
    """The source file of dotted module ``name`` under ``root`` (a module or a package's ``__init__``), or None
    (an attribute imported from a module, or no such module)."""
    base = root.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def module_closure(entries: tuple[str, ...], root: Path = LIBRARY_ROOT, package: str = "evoharness") -> list[Path]:
    """The source files of the ``package`` modules ``entries`` run: each entry, its parent packages' ``__init__``
    and every ``package`` module it imports, transitively, read statically from the code (``ast``: imports inside
    functions and subpackages
    included), sorted. Raises FileNotFoundError for an entry that is not a module under ``root``."""
    seen: set[Path] = set()
    todo = list(entries)
    for name in entries:
        if _module_file(name, root) is None:
            raise FileNotFoundError(f"{name}: no module {name.replace('.', '/')}.py under {root}")
    while todo:
        name = todo.pop()
        path = _module_file(name, root)
        if path is None or path in seen:
            continue
        seen.add(path)
        todo += [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]  # parents run first
        parts = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                todo += [a.name for a in node.names if a.name.split(".")[0] == package]
            elif isinstance(node, ast.ImportFrom):
                mod = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else (node.module or "")
                if mod.split(".")[0] == package:  # the module, and its names that are submodules
                    todo += [mod] + [f"{mod}.{a.name}" for a in node.names]
    return sorted(seen)


def library_digest(entries: tuple[str, ...], root: Path = LIBRARY_ROOT) -> str:
    """sha256 of the source a stage runs (``module_closure`` of its entry modules): a stage's output depends on
    that code, so a change to it gives new output folders and cache keys, while an edit elsewhere in the library
    (a plot's docstring) reuses a finished 90-minute SFT."""
    h = hashlib.sha256()
    for path in module_closure(entries, root):
        h.update(str(path.relative_to(root)).encode() + path.read_bytes())
    return h.hexdigest()


def content_key(code: tuple[str, ...], *parts) -> str:
    """16 hex chars of sha256 over the JSON of ``parts`` (dataclasses as dicts) and the source of the library
    modules ``code`` runs (``library_digest``)."""
    blob = json.dumps([library_digest(code), *parts], sort_keys=True,
                      default=lambda o: getattr(o, "__dict__", str(o)))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def stage_policy(out_dir_fn):
    """A cache policy for a task whose output folder is ``out_dir_fn(parameters)``."""

    def key(_ctx, parameters: dict) -> str:
        out = Path(out_dir_fn(parameters))
        out.mkdir(parents=True, exist_ok=True)
        epoch = out / ".cache-epoch"
        if not epoch.exists():
            epoch.write_text(uuid.uuid4().hex)
        # the folder's name already holds the stage's code and inputs; the epoch tells a rebuilt folder apart
        return hashlib.sha256(f"{out}:{epoch.read_text()}".encode()).hexdigest()[:16]

    return TASK_SOURCE + CacheKeyFnPolicy(cache_key_fn=key)


def run_stage(task, *args, **kwargs) -> tuple[object, bool]:
    """Call a Prefect task; return (its result, whether Prefect served it from the cache)."""
    state = task(*args, return_state=True, **kwargs)
    return state.result(), state.name == "Cached"


def transient_only(_task, _task_run, state) -> bool:
    """Prefect ``retry_condition_fn``: retry crashes and flaky failures, never deterministic input errors (a missing
    split or game, a bad record, a data-version mismatch, a bad config), which would fail the same way again."""
    from evoharness.data.datastore import DataVersionMismatch
    from evoharness.data.pinned import DataVersionUnavailable
    from evoharness.data.rawlog import RawLogError

    try:
        state.result()
    except (FileNotFoundError, ValueError, RawLogError, DataVersionMismatch, DataVersionUnavailable, KeyError,
            TypeError):
        return False
    except Exception:
        return True
    return True


# The retry policy of every flaky stage: two retries with backoff, transient failures only.
RETRY = {"retries": 2, "retry_delay_seconds": [10, 60], "retry_condition_fn": transient_only}
