"""Raw execution-log collection: ALFWorld games played by the handcoded expert, some episodes perturbed.

Output layout (a directory, versioned with ``dvc add``)::

    data/
      manifest.json            collection settings and totals (no timestamps: byte-identical reruns)
      logs/shard-00000.jsonl   one JSON record per step, see ``evoharness.data.rawlog`` for the schema

Determinism: every episode's randomness (the expert's tie-breaks, the perturbations) derives from
``CollectConfig.seed`` and the game path, and results are written in game order whatever the worker count,
so the same games, seeds and settings give byte-identical files (hence the same DVC md5). ALFWorld's handcoded
expert also depends on Python's string hash seed (measured 2026-12-01, before ``env.alfworld._tracking_moves``: in
``train/pick_two_obj_and_place-CellPhone-None-Shelf-320/trial_T20190908_113058_584290`` its 25th command was ``go to
desk 2`` under ``PYTHONHASHSEED`` 0, 1 and 3 and ``take cellphone 1 from shelf 2`` under 2, 4 and 5), so the workers
are started with it pinned (``expert_pool``). The manifest names the expert (``settings.expert``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import multiprocessing as mp
import os
import random
import re
import resource
import shutil
import signal
import time
from pathlib import Path

from evoharness.config import CollectConfig
from evoharness.env.alfworld import (
    EXPERT,
    ALFWorldEnv,
    import_environment,
    list_games,
    pinned_hash_seed,
    task_type_of,
)


def episode_seed(seed: int, game: str) -> int:
    """A stable 31-bit seed from the base seed and the game path (not Python's salted ``hash``)."""
    return int(hashlib.sha256(f"{seed}:{game}".encode()).hexdigest()[:8], 16) & 0x7FFFFFFF


def invalid_command(rng: random.Random, admissible: list[str]) -> str:
    """A command the game rejects with "Nothing happens.": the pre-2025 ``put X in/on Y`` form of an admissible
    ``move X to Y``, or else an admissible command aimed at an object number that does not exist (99)."""
    moves = [c for c in admissible if c.startswith("move ")]
    if moves:
        obj, recep = rng.choice(moves)[len("move "):].split(" to ", 1)
        return f"put {obj} {rng.choice(['in', 'on'])} {recep}"
    return re.sub(r" \d+", " 99", rng.choice(admissible), count=1)


class EpisodeTimeout(Exception):
    pass


def _alarm(_signum, _frame):
    raise EpisodeTimeout()


def play_expert_episode(game: str, cfg: CollectConfig, data_dir: str | None = None) -> list[dict]:
    """Play one game with the handcoded expert (perturbed for a ``cfg.perturb_share`` of games).

    Returns the step records (step 0 = the initial observation, ``action`` null). An expert that raises or stalls
    past ``cfg.episode_timeout_s`` ends the episode unwon, with ``error`` on its last record; it never raises.
    """
    seed = episode_seed(cfg.seed, game)
    rng = random.Random(seed)
    perturbed = rng.random() < cfg.perturb_share
    episode_id = str(Path(game).parent)
    base = {"game": game, "task_type": task_type_of(game), "episode_id": episode_id}
    records: list[dict] = []
    env = None
    use_alarm = hasattr(signal, "SIGALRM") and cfg.episode_timeout_s > 0
    if use_alarm:
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, cfg.episode_timeout_s)
    try:
        env = ALFWorldEnv(game, max_steps=cfg.max_steps, expert=True, data_dir=data_dir)
        res = env.reset(seed=seed)
        records.append({**base, "step": 0, "observation": res.observation,
                        "admissible_commands": res.admissible_commands, "action": None, "action_source": None,
                        "reward": 0.0, "done": False, "won": False})
        for step in range(1, cfg.max_steps + 1):
            source = "expert"
            action = res.expert_action or "look"
            if perturbed and rng.random() < cfg.perturb_step_prob:
                if rng.random() < cfg.invalid_share:
                    action, source = invalid_command(rng, res.admissible_commands), "invalid"
                else:
                    moves = [c for c in res.admissible_commands if c != "help"] or ["look"]
                    action, source = rng.choice(moves), "random"
            res = env.step(action)
            records.append({**base, "step": step, "observation": res.observation,
                            "admissible_commands": res.admissible_commands, "action": action,
                            "action_source": source, "reward": res.reward, "done": res.done, "won": res.won})
            if res.done:
                break
    except EpisodeTimeout:
        _mark_failed(records, base, f"expert stalled past {cfg.episode_timeout_s}s")
    except Exception as exc:  # the expert raises on some states (e.g. choosing from an empty list)
        _mark_failed(records, base, f"{type(exc).__name__}: {exc}")
    finally:
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        if env is not None:
            env.close()
    for r in records:
        r["perturbed"] = perturbed
    return records


def _mark_failed(records: list[dict], base: dict, reason: str) -> None:
    if not records:
        records.append({**base, "step": 0, "observation": "", "admissible_commands": [], "action": None,
                        "action_source": None, "reward": 0.0, "done": True, "won": False})
    records[-1]["done"], records[-1]["won"], records[-1]["error"] = True, False, reason


_EPISODES_IN_WORKER = 0


def rss_mb() -> float:
    """This process's resident memory now, in MiB (``/proc/self/statm``; peak RSS from ``getrusage`` elsewhere)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _failed(saved: Path) -> bool:
    """Whether a saved episode ended in an error (``play_expert_episode``): a rerun plays it again, since a stall
    past ``episode_timeout_s`` mostly means a loaded machine, not a bad game (2026-12-02: 185 of 1,850 episodes,
    collected beside two training runs, timed out; none did alone)."""
    return "error" in _saved_records(json.loads(saved.read_text()))[-1]


def _saved_records(saved: dict | list) -> list[dict]:
    """A saved episode's records: ``{"records", "worker"}``, or a bare list (written before worker stats)."""
    return saved["records"] if isinstance(saved, dict) else saved


def _worker(args):
    global _EPISODES_IN_WORKER
    game, cfg_dict, data_dir = args
    t0 = time.time()
    records = play_expert_episode(game, CollectConfig(**cfg_dict), data_dir)
    _EPISODES_IN_WORKER += 1
    stats = {"pid": os.getpid(), "episode_in_worker": _EPISODES_IN_WORKER, "wall_s": round(time.time() - t0, 3),
             "str_hash": hash("evoharness"),  # the same in every run only while the hash seed is pinned
             "rss_mb": round(rss_mb(), 1),
             "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    return game, records, stats


@contextlib.contextmanager
def expert_pool(processes: int, **pool_kwargs):
    """A ``multiprocessing`` pool whose workers run with ``PYTHONHASHSEED=EXPERT_HASH_SEED``, whatever this process's
    hash seed, so ALFWorld's handcoded expert makes the same choices in every run (module docstring). Workers are
    started with ``spawn`` (a forked worker keeps its parent's hash seed, and the seed is read only at interpreter
    start); the variable is set while the pool lives (``pinned_hash_seed``), since ``maxtasksperchild`` starts new
    workers along the way. ``pool_kwargs`` go to ``Pool`` (initializer, maxtasksperchild, ...)."""
    with pinned_hash_seed(), mp.get_context("spawn").Pool(processes, **pool_kwargs) as pool:
        yield pool


def profile_games(cfg: CollectConfig, data_dir: str | None = None) -> list[str]:
    """The games a collection with ``cfg`` plays: ``cfg.split`` sorted by path, every ``cfg.stride``-th, the first
    ``cfg.num_games`` (0: all). Raises FileNotFoundError when the split's games are missing."""
    return list_games(cfg.split, limit=cfg.num_games, stride=cfg.stride, data_dir=data_dir)


def log_settings(cfg: CollectConfig) -> dict:
    """What decides the logs' bytes: ``cfg.content_settings()`` and the expert (``env.alfworld.EXPERT``)."""
    return cfg.content_settings() | {"expert": EXPERT}


def partial_dir(out_dir: str | Path, cfg: CollectConfig) -> Path:
    """Where finished episodes wait until the shards are written: ``<out_dir>.partial-<settings hash>/``, beside
    (not inside) ``out_dir``, keyed on ``log_settings`` so a rerun with other settings or expert never mixes them in."""
    settings = json.dumps(log_settings(cfg), sort_keys=True)
    out = Path(out_dir)
    return out.parent / f"{out.name}.partial-{hashlib.sha256(settings.encode()).hexdigest()[:12]}"


def collect(games: list[str], out_dir: str | Path, cfg: CollectConfig, data_dir: str | None = None,
            progress=None) -> dict:
    """Play ``games`` and write ``out_dir/logs/shard-*.jsonl`` plus ``out_dir/manifest.json``.

    Each finished episode is first written to ``partial_dir`` (one file per game, renamed into place when
    complete), so a killed collection rerun with the same settings plays only the games still missing or failed
    (``_failed``: an error on the last record, e.g. a stall past ``cfg.episode_timeout_s``), and no episode is
    duplicated or lost; the partial folder is removed once the shards are written. Workers are recycled
    every ``cfg.games_per_worker`` games (TextWorld's reset leaks). ``progress`` is called as
    ``progress(done, total, episodes_per_min, eta_s)``. Returns the manifest (episodes, steps, won, failed,
    settings) plus ``wall_s``, ``resumed`` (episodes found from an earlier run) and ``worker_stats``: per episode, in
    completion order, the worker's pid, how many episodes it had played, the episode's wall seconds, its hash of a
    fixed string (``str_hash``: the same across runs while ``expert_pool`` pins the seed), and the worker's
    resident and peak memory in MiB (not in the manifest: the logs' bytes stay independent of timing). The workers
    are spawned (``expert_pool``), so a script that calls this must do so under ``if __name__ == "__main__":``.
    """
    out = Path(out_dir)
    partial = partial_dir(out, cfg)
    partial.mkdir(parents=True, exist_ok=True)
    name = {g: f"{i:06d}.json" for i, g in enumerate(games)}
    done = {g for g in games if (partial / name[g]).exists() and not _failed(partial / name[g])}
    todo = [g for g in games if g not in done]
    workers = cfg.workers or mp.cpu_count()
    t0 = time.time()
    jobs = [(g, dataclasses.asdict(cfg), str(data_dir) if data_dir else None) for g in todo]
    finished = 0
    if jobs:
        # spawned workers start with default signal handlers: Prefect's SIGTERM handler is not inherited
        with expert_pool(min(workers, len(jobs)), initializer=import_environment,
                         maxtasksperchild=cfg.games_per_worker) as pool:
            for game, records, stats in pool.imap_unordered(_worker, jobs):
                tmp = partial / (name[game] + ".tmp")
                tmp.write_text(json.dumps({"records": records, "worker": stats | {"order": len(done) + finished}},
                                          sort_keys=True))
                tmp.rename(partial / name[game])
                finished += 1
                if progress:
                    rate = finished / max(time.time() - t0, 1e-9) * 60
                    progress(len(done) + finished, len(games), rate, (len(todo) - finished) / max(rate / 60, 1e-9))
    saved = [json.loads((partial / name[g]).read_text()) for g in games]
    ordered = [_saved_records(s) for s in saved]
    workers_stats = sorted((s["worker"] for s in saved if isinstance(s, dict)), key=lambda w: w["order"])
    (out / "logs").mkdir(parents=True, exist_ok=True)
    for shard, start in enumerate(range(0, len(ordered), cfg.shard_size)):
        lines = [json.dumps(r, sort_keys=True) for ep in ordered[start:start + cfg.shard_size] for r in ep]
        (out / "logs" / f"shard-{shard:05d}.jsonl").write_text("\n".join(lines) + "\n")
    manifest = {
        "settings": log_settings(cfg),
        "episodes": len(ordered),
        "steps": sum(len(ep) - 1 for ep in ordered),
        "won": sum(ep[-1]["won"] for ep in ordered),
        "perturbed": sum(ep[0]["perturbed"] for ep in ordered),
        "failed": sorted({ep[-1]["episode_id"]: ep[-1]["error"] for ep in ordered if "error" in ep[-1]}.items()),
        "games": games,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    shutil.rmtree(partial)
    return manifest | {"wall_s": time.time() - t0, "resumed": len(done), "worker_stats": workers_stats}
