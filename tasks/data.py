"""Prefect tasks for the data stages: collect (DVC-versioned raw logs) and ingest (read at a data rev)."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from evoharness import datastore, rawlog
from evoharness.alfworld_env import list_games
from evoharness.config import PipelineConfig
from evoharness.tracking import start_run
from tasks.caching import transient_only


@task(
    name="collect",
    retries=1,
    retry_condition_fn=transient_only,
    retry_delay_seconds=5,
    timeout_seconds=6 * 3600,
    cache_policy=NO_CACHE,
)
def collect_task(cfg: PipelineConfig, repo: str, parent_run_id: str) -> dict:
    """Ensure ``data/`` holds the raw logs that ``data.dvc`` names (collect or regenerate them when missing)."""
    log = get_run_logger()
    c = cfg.collect
    games = list_games(c.split, limit=c.num_games, stride=c.stride)
    with start_run("collect", parent_run_id):
        mlflow.log_params({f"collect.{k}": v for k, v in c.__dict__.items()})
        out = datastore.ensure_data(
            repo,
            c,
            games,
            progress=lambda d, t, rate, eta: (
                log.info(f"collect {d}/{t} episodes, {rate:.1f} episodes/min, ETA {eta:.0f}s")
                if d % 5 == 0 or d == t
                else None
            ),
        )
        mlflow.set_tags({"data_status": out["status"], "dvc_md5": out["md5"]})
        if out["manifest"]:
            m = out["manifest"]
            mlflow.log_metrics(
                {
                    "episodes": m["episodes"],
                    "steps": m["steps"],
                    "won": m["won"],
                    "perturbed": m["perturbed"],
                    "failed": len(m["failed"]),
                    "wall_s": m["wall_s"],
                }
            )
    log.info(f"data {out['status']}: md5 {out['md5']}")
    return {"status": out["status"], "md5": out["md5"]}


@task(name="ingest", timeout_seconds=3600, cache_policy=NO_CACHE)
def ingest_task(repo: str, data_rev: str | None, parent_run_id: str, on_error: str = "stop") -> tuple[list, str]:
    """Read and validate the raw logs at ``data_rev`` through ``dvc.api``; return (episodes, DVC md5).

    ``on_error="quarantine"`` writes bad records to ``runs/quarantine/<md5>.jsonl`` (also an MLflow artifact)."""
    log = get_run_logger()
    quarantine = [] if on_error == "quarantine" else None
    with start_run("ingest", parent_run_id, tags={"data_rev": data_rev or "workspace", "on_error": on_error}):
        episodes, md5 = rawlog.read_episodes(repo, data_rev, quarantine=quarantine)
        mlflow.set_tag("dvc_md5", md5)
        mlflow.MlflowClient().set_tag(parent_run_id, "dvc_md5", md5)
        mlflow.log_metrics(
            {
                "episodes": len(episodes),
                "steps": sum(len(e.records) - 1 for e in episodes),
                "won": sum(e.won for e in episodes),
                "quarantined_records": len(quarantine or []),
            }
        )
        if quarantine:
            side = Path(repo) / "runs" / "quarantine" / f"{md5.removesuffix('.dir')}.jsonl"
            side.parent.mkdir(parents=True, exist_ok=True)
            side.write_text("".join(json.dumps(q) + "\n" for q in quarantine))
            mlflow.log_artifact(str(side))
            log.warning(f"{len(quarantine)} raw-log records quarantined to {side}; first: {quarantine[0]['error']}")
    log.info(f"ingested {len(episodes)} episodes at rev {data_rev or 'workspace'} (md5 {md5})")
    return episodes, md5
