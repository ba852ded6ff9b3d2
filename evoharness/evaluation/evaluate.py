"""Evaluation: play a split's games with a policy and report ALFWorld success (``won``, never ``done``).

Policies: ``expert`` (ALFWorld's handcoded expert), ``random`` (uniform admissible), a local model folder, a hub id,
or an MLflow model URI (``models:/NAME@ALIAS``, ``models:/m-<id>``, ``runs:/...``).
"""

from __future__ import annotations

from pathlib import Path

from evoharness.config import CostConfig, EvalConfig, TraceConfig
from evoharness.env.alfworld import TASK_TYPES
from evoharness.evaluation.play import (  # noqa: F401  (the names callers take from here: one place to import evaluation from)
    ENVIRONMENT_FAILURES,
    environment_failed,
    evaluation_identity,
    make_policy,
    play_games,
    resolve_model_path,
)
from evoharness.evaluation.workers import evaluate_sharded
from evoharness.harness.workspace import META_ACTIONS


def spread(games: list[str], limit: int) -> list[str]:
    """``limit`` games at evenly spaced positions of the sorted list (all task types, not just the first
    folder's); ``limit`` 0 or >= len(games) gives every game."""
    if not limit or limit >= len(games):
        return list(games)
    return [games[i * len(games) // limit] for i in range(limit)]


def summarize(results, split: str, games_total: int) -> dict:
    """Success rate overall and by task type; mean steps, meta-actions (by type), generated tokens and grounded
    track names (``ground_track``; None when a kept episode predates the count) per episode.

    ``won_by_game`` maps each game (its path relative to ``json_2.1.1``) to ALFWorld's ``won``, so that two
    evaluations on the same games can be compared paired (``scripts/paired_test.py``) from their summaries alone,
    after the run folders with the transcripts are gone."""
    n = max(len(results), 1)
    by_type: dict[str, list[bool]] = {}
    meta_by_type: dict[str, list[dict]] = {}
    for r in results:
        by_type.setdefault(TASK_TYPES.get(r.task_type, r.task_type), []).append(r.won)
        meta_by_type.setdefault(TASK_TYPES.get(r.task_type, r.task_type), []).append(r.meta_actions)
    return {
        "split": split,
        "episodes": len(results),
        "games_in_split": games_total,
        "success_rate": sum(r.won for r in results) / n,
        "success_by_task_type": {k: sum(v) / len(v) for k, v in sorted(by_type.items())},
        "episodes_by_task_type": {k: len(v) for k, v in sorted(by_type.items())},
        "mean_steps": sum(r.env_steps for r in results) / n,
        "meta_actions_per_episode": {m: sum(r.meta_actions.get(m, 0) for r in results) / n for m in META_ACTIONS},
        "meta_actions_by_task_type": {t: {m: sum(x.get(m, 0) for x in v) / len(v) for m in META_ACTIONS}
                                      for t, v in sorted(meta_by_type.items())},
        "generated_tokens_per_episode": sum(r.generated_tokens for r in results) / n,
        "cost_per_episode": sum(r.cost for r in results) / n,
        "cost_per_episode_by_type": {m: sum(r.cost_by_type.get(m, 0.0) for r in results) / n for m in META_ACTIONS},
        "malformed_per_episode": sum(r.malformed for r in results) / n,
        "rejected_turns_per_episode": sum(r.rejected_turns for r in results) / n,
        "remapped_per_episode": sum(r.remapped for r in results) / n,
        "appended_acts_per_episode": sum(sum(1 for t in r.transcript if t.get("appended")) for r in results) / n,
        # None when an episode did not record it (kept from a folder written before 2026-12-02)
        "grounded_names_per_episode": (None if any(r.grounded_names is None for r in results)
                                       else sum(r.grounded_names for r in results) / n),
        "mean_reward": sum(r.reward for r in results) / n,
        "errors": [f"{r.game}: {r.error}" for r in results if r.error],
        "won_by_game": {r.game: bool(r.won) for r in results},
        "environment_failures": sum(environment_failed(r.error) for r in results),
    }


def evaluate(policy: str, games: list[str], cfg: EvalConfig, cost: CostConfig, out_dir: str | Path,
             experience_path: str | None = None, data_dir: str | None = None, games_total: int | None = None,
             progress=print, workspace_cfg: TraceConfig | None = None, identity: str | None = None,
             run_shards=None) -> dict:
    """Play each game once with ``policy``; write ``transcripts.jsonl`` and return the summary dict.

    ``experience_path``: an Experience store to start from (copied, so evaluation never changes it).
    An environment that raises ends that episode as failed (``errors`` and ``environment_failures`` in the
    summary); the run continues. ``cfg.workers`` > 1 plays the games in that many processes
    (``evoharness.evaluation.workers.evaluate_sharded``), each appending to a shard folder of its own under ``out_dir``;
    ``out_dir/transcripts.jsonl`` is then written once, in game order. ``wall_s``: seconds spent playing, after the
    policy has loaded (sharded: from the workers' start to the last one's end, their loading included).

    Resumes: a folder that already holds episodes of the same policy (``identity``, default ``policy``; pin a
    version, an alias or a retrained folder is the same string) with the same ``cfg``, ``cost`` and
    ``workspace_cfg`` keeps them and plays only the missing games and those whose environment failed
    (``environment_failed``); ``resumed_episodes`` in the summary counts the kept ones. Each episode is appended as
    it ends, and the file is rewritten in game order at the end. The folder's Experience store is kept too, with
    any notes the interrupted episode wrote; ``forced_acts`` and ``wall_s`` count this session only. Raises
    ValueError when ``out_dir`` holds another policy's or other settings' evaluation. ``run_shards``: how the
    shards of a ``workers`` > 1 evaluation run (``evaluate_sharded``; None: local processes).
    """
    if cfg.workers > 1 and len(games) > 1:
        results, stats = evaluate_sharded(policy, games, cfg, cost, Path(out_dir), experience_path, data_dir,
                                          progress, workspace_cfg, identity, run_shards)
    else:
        results, stats = play_games(policy, games, cfg, cost, Path(out_dir), experience_path, data_dir, progress,
                                    workspace_cfg, identity)
    split = Path(games[0]).parts[0] if games else cfg.split
    return summarize(results, split, games_total or len(games)) | stats | {"policy": policy}
