"""Prefect tasks: evaluation on a split, and model logging + registration with lineage."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

import mlflow
from evoharness.alfworld_env import list_games
from evoharness.config import CostConfig, EvalConfig
from evoharness.evaluate import evaluate, spread
from evoharness.tracking import flat, log_and_register, start_run


@task(name="evaluate", retries=1, retry_delay_seconds=5, timeout_seconds=6 * 3600, cache_policy=NO_CACHE)
def evaluate_task(policy: str, cfg: EvalConfig, cost: CostConfig, work_dir: str, parent_run_id: str | None,
                  experience_path: str | None = None, model_uri: str | None = None) -> dict:
    """Play ``cfg.limit`` evenly spaced games of ``cfg.split`` (0 = all) with ``policy``; log the summary to a
    (nested) run."""
    log = get_run_logger()
    all_games = list_games(cfg.split)
    games = spread(all_games, cfg.limit)
    out = Path(work_dir) / f"eval-{cfg.split}"
    with start_run(f"evaluate-{cfg.split}", parent_run_id,
                   tags={"policy": policy, "split": cfg.split, "model_uri": model_uri or policy}) as run:
        mlflow.log_params({f"evaluate.{k}": v for k, v in cfg.__dict__.items()})
        summary = evaluate(policy, games, cfg, cost, out, experience_path, games_total=len(all_games),
                           progress=log.info)
        mlflow.log_metrics(flat("", {k: v for k, v in summary.items() if k != "errors"}))
        mlflow.log_dict(summary, "summary.json")
        mlflow.log_artifact(str(out / "transcripts.jsonl"))
        summary["mlflow_run_id"] = run.info.run_id
    log.info(f"evaluate {cfg.split}: success {summary['success_rate']:.3f} over {summary['episodes']} episodes")
    return summary


@task(name="register", retries=1, timeout_seconds=1800, cache_policy=NO_CACHE)
def register_task(model_path: str, registered_name: str, lineage: dict, parent_run_id: str) -> dict:
    """Log the final policy, register it under ``registered_name`` with alias ``candidate`` and lineage tags."""
    with start_run("register", parent_run_id, tags=lineage):
        info = log_and_register(model_path, registered_name, "candidate", lineage)
    get_run_logger().info(f"registered {info['model_uri']} (alias candidate)")
    return info
