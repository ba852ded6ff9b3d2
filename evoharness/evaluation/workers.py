"""Evaluation in several processes (``evaluate.workers``): the games are dealt round-robin to worker processes,
each with its own copy of the policy and of the Experience store, as ``evoharness.data.dagger`` plays its episodes.

Worker k of W plays ``games[k::W]`` in order into ``<out>/shard-k-of-W/``, a folder that resumes like any
evaluation folder (``evoharness.evaluation.play.play_games``); each game keeps the seed and workspace name of its
position in the whole list. The shards' rows are then written to ``<out>/transcripts.jsonl`` in game order. What a
policy recalls from Experience, and ``random``'s draws, depend on the episodes played before in the same process, so
those can differ from a one-process evaluation; the expert's outcomes do not (``tests/test_evaluate_workers.py``).
The shards' processes start with the string hash seed pinned (``env.alfworld.pinned_hash_seed``), so the expert
breaks ties between equal objects the same way in every shard, whichever executor runs them: a local process pool,
or Prefect tasks on a Dask cluster (``run_shards``, ``evaluate.task_runner``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import multiprocessing as mp
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from evoharness.config import CostConfig, EvalConfig, TraceConfig
from evoharness.env.alfworld import EXPERT_HASH_SEED, pinned_hash_seed


def _exit_with_parent(parent: int, poll_s: float = 1.0) -> None:
    """Worker: end this process once ``parent`` (the evaluation that started it) is gone. A shard is one long task,
    so a worker whose evaluation was killed (SIGKILL, or a SIGTERM that skips Python's clean-up) would otherwise
    play its whole shard on as an orphan, using the cores and appending to a folder that a re-run resumes into."""
    def watch():
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def play_shard(args: tuple) -> tuple[list[dict], dict]:
    """Worker: play one shard (``play_games``) and return its rows as dicts (picklable) and its stats. ``args`` is
    one job of ``evaluate_sharded``, plain data only, so any executor can ship it to a process of its own."""
    (policy, games, indices, cfg_dict, cost_dict, out, experience_path, data_dir, workspace_dict, identity,
     label, threads, quiet, parent) = args
    if parent is not None:  # a process of our own pool; a cluster's workers are its own to end
        _exit_with_parent(parent)
    import torch

    from evoharness.evaluation.play import play_games

    torch.set_num_threads(threads)  # the workers share the cores
    results, stats = play_games(policy, games, EvalConfig(**cfg_dict), CostConfig(**cost_dict), Path(out),
                                experience_path, data_dir, None if quiet else functools.partial(print, flush=True),
                                TraceConfig(**workspace_dict) if workspace_dict else None, identity, indices, label)
    return [r.__dict__ for r in results], stats


def play_shard_in_subprocess(args: tuple) -> tuple[list[dict], dict]:
    """``play_shard`` in a fresh interpreter (``python -m evoharness.evaluation.workers JOB RESULT``) started with the
    expert's hash seed (``pinned_hash_seed``), which ends with the calling process: for executors whose own worker
    processes carry another seed (Dask's nannies replace 0 with 6640) or may not start children of their own
    (daemonic workers). The job and the result travel as JSON files in the shard's folder. Raises RuntimeError with
    the command's last output lines when it fails."""
    import subprocess
    import sys

    job = list(args)
    job[-1] = os.getpid()  # the child ends with this process
    folder = Path(job[5])
    folder.mkdir(parents=True, exist_ok=True)
    job_file, result_file = folder / "job.json", folder / "result.json"
    job_file.write_text(json.dumps(job))
    result_file.unlink(missing_ok=True)
    proc = subprocess.run([sys.executable, "-m", "evoharness.evaluation.workers", str(job_file), str(result_file)],
                          env=os.environ | {"PYTHONHASHSEED": EXPERT_HASH_SEED}, stderr=subprocess.PIPE, text=True)
    if proc.returncode or not result_file.exists():  # its progress lines went to this process's stdout
        tail = "\n".join(proc.stderr.strip().splitlines()[-8:])
        raise RuntimeError(f"evaluation shard {folder} failed (exit {proc.returncode}); the episodes it finished are "
                           f"kept there and a re-run resumes them:\n{tail}")
    rows, stats = json.loads(result_file.read_text())
    return rows, stats


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # the cores this process may run on (affinity, cgroup cpusets)
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def evaluate_sharded(policy: str, games: list[str], cfg: EvalConfig, cost: CostConfig, out: Path,
                     experience_path: str | None, data_dir: str | None, progress,
                     workspace_cfg: TraceConfig | None, identity: str | None,
                     run_shards=None) -> tuple[list, dict]:
    """Play ``games`` in ``min(cfg.workers, len(games))`` processes (module docstring); returns the
    ``EpisodeResult`` of each game in ``games`` order and the shards' stats (``resumed_episodes`` and
    ``forced_acts`` summed; ``wall_s`` from the workers' start to the last one's end).

    ``run_shards``: how the shards run, a callable taking the list of jobs and returning ``play_shard(job)`` of
    each, in order (e.g. Prefect tasks on a Dask cluster: ``tasks.evaluation``). None: a local pool of spawned
    processes that end with this one. The shards, their folders and what they return are the same either way.

    An MLflow model URI is downloaded once, here, into ``<out>/model_cache``; the workers load the local folder,
    while the evaluation's identity stays the URI. Each worker prints its progress lines (``[evaluate
    shard-k-of-W] n/N won=... episodes/min, ETA ... min``) to its stdout unless ``progress`` is None. Raises
    ValueError when ``out`` or a shard folder holds another policy's or other settings' evaluation (nothing is
    written over), ``concurrent.futures.process.BrokenProcessPool`` when a worker dies (killed, out of memory):
    the finished episodes stay in the shard folders and a re-run resumes them."""
    from evoharness.evaluation.play import evaluation_identity, resolve_model_path, resumable, write_atomic
    from evoharness.policy.agent import EpisodeResult

    workers = min(cfg.workers, len(games))
    out.mkdir(parents=True, exist_ok=True)
    ident = evaluation_identity(policy, cfg, cost, workspace_cfg, identity)
    resumable(out, ident, None)  # raises before anything is written over another evaluation's rows
    local = resolve_model_path(policy, out / "model_cache")  # names and folders pass through
    threads = max(1, _cores() // workers)
    shard_indices = [list(range(k, len(games), workers)) for k in range(workers)]
    jobs = []
    for k, idx in enumerate(shard_indices):
        jobs.append((local, [games[i] for i in idx], idx, dataclasses.asdict(cfg), dataclasses.asdict(cost),
                     str(out / f"shard-{k}-of-{workers}"), experience_path, data_dir,
                     dataclasses.asdict(workspace_cfg) if workspace_cfg else None, identity or policy,
                     f"evaluate shard-{k}-of-{workers}", threads, progress is None,
                     os.getpid() if run_shards is None else None))
    if progress:
        where = "processes" if run_shards is None else "cluster tasks"
        progress(f"[evaluate] {len(games)} games in {workers} {where} ({threads} thread(s) each), shards under {out}")
    t0 = time.time()
    with pinned_hash_seed():  # the expert's choices are the same in every shard's process
        if run_shards is not None:
            shards = list(run_shards(jobs))
        else:
            with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
                shards = list(pool.map(play_shard, jobs))
    results: list = [None] * len(games)
    for (rows, _), idx in zip(shards, shard_indices):
        for i, row in zip(idx, rows):  # by position: a game listed twice keeps both episodes
            results[i] = EpisodeResult(**row)
    stats = {**shards[-1][1], "wall_s": time.time() - t0,  # decoding and context: the same in every shard
             **{k: sum(st[k] for _, st in shards) for k in ("resumed_episodes", "forced_acts")}}
    write_atomic(out / "evaluation.json", json.dumps(ident))  # first: rows without it would be refused
    write_atomic(out / "transcripts.jsonl", "".join(json.dumps(r.__dict__) + "\n" for r in results))
    return results, stats


if __name__ == "__main__":  # play_shard_in_subprocess's child: python -m evoharness.evaluation.workers JOB RESULT
    import sys

    _rows, _stats = play_shard(tuple(json.loads(Path(sys.argv[1]).read_text())))
    Path(sys.argv[2]).write_text(json.dumps([_rows, _stats]))
