"""Prefect tasks for the data stages: collect (DVC-versioned raw logs) and ingest (read at a data rev)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlflow
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from evoharness.config import PipelineConfig
from evoharness.data import datastore, pinned, rawlog
from evoharness.data.collect import profile_games
from evoharness.env.alfworld import list_games
from evoharness.evaluation.plots import memory_figure
from evoharness.registry.tracking import start_run
from tasks.caching import transient_only


@task(
    name="collect",
    retries=1,
    retry_condition_fn=transient_only,
    retry_delay_seconds=5,
    timeout_seconds=6 * 3600,
    cache_policy=NO_CACHE,
)
def collect_task(cfg: PipelineConfig, repo: str, parent_run_id: str, data_rev: str | None = None) -> dict:
    """Ensure ``<collect.path>/`` holds the raw logs its ``.dvc`` file names (check out, pull, collect or
    regenerate), push them to the default DVC remote, and log the collection's figures (episodes/min, worker memory).
    With ``data_rev``: leave the workspace alone and make the DVC cache hold the version that rev names instead
    (``evoharness.data.pinned.ensure_version_at``: cached, pulled, or regenerated with the rev's own code)."""
    log = get_run_logger()
    c = cfg.collect
    if data_rev:
        with start_run("collect", parent_run_id):
            out = pinned.ensure_version_at(repo, data_rev, c.path, cfg.profile)
            mlflow.set_tags({"data_status": out["status"], "dvc_md5": out["md5"], "data_path": c.path,
                             "data_rev": data_rev})
        log.info(f"data at rev {data_rev} {out['status']}: md5 {out['md5']}")
        return {"status": out["status"], "md5": out["md5"], "pushed": None}
    games = profile_games(c)
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
        mlflow.set_tags({"data_status": out["status"], "dvc_md5": out["md5"], "data_path": c.path,
                         "dvc_remote": datastore.default_remote(repo) or "none"})
        if out["pushed"] is not None:
            mlflow.log_metric("dvc_pushed_files", out["pushed"])
        if out.get("push_error"):
            mlflow.set_tag("dvc_push_error", out["push_error"][:500])
            log.warning(out["push_error"])
        if out["manifest"]:
            m = out["manifest"]
            ws = m["worker_stats"]
            played = [w for w in ws if w["order"] >= m["resumed"]]  # this run's episodes, not resumed ones
            mlflow.log_metrics(
                {
                    "episodes": m["episodes"],
                    "steps": m["steps"],
                    "won": m["won"],
                    "perturbed": m["perturbed"],
                    "failed": len(m["failed"]),
                    "wall_s": m["wall_s"],
                    "worker_peak_rss_mb": max((w["peak_rss_mb"] for w in ws), default=0.0),
                }
            )
            if played:
                mlflow.log_metric("episodes_per_min", len(played) / max(m["wall_s"], 1e-9) * 60)
            if ws:
                mlflow.log_figure(memory_figure(ws), "worker_memory.png")
                mlflow.log_text("".join(json.dumps(w) + "\n" for w in ws), "worker_stats.jsonl")
    log.info(f"data {out['status']}: md5 {out['md5']}, pushed {out['pushed']}")
    return {"status": out["status"], "md5": out["md5"], "pushed": out["pushed"]}


@task(name="ingest", timeout_seconds=3600, cache_policy=NO_CACHE)
def ingest_task(repo: str, data_rev: str | None, parent_run_id: str, on_error: str = "stop",
                data_path: str = "data") -> tuple[list, str, int]:
    """Read and validate the raw logs under ``<data_path>/logs`` at ``data_rev`` through ``dvc.api``; return
    (episodes, DVC md5, number of records quarantined).

    ``on_error="quarantine"`` writes bad records to ``runs/quarantine/<md5>.jsonl`` (also an MLflow artifact) and
    counts them (metric ``quarantined_records``); ``stop`` raises RawLogError at the first, saying what to do."""
    log = get_run_logger()
    quarantine = [] if on_error == "quarantine" else None
    tags = {"data_rev": data_rev or "workspace", "on_error": on_error, "data_path": data_path}
    with start_run("ingest", parent_run_id, tags=tags):
        try:
            episodes, md5 = rawlog.read_episodes(repo, data_rev, f"{data_path}/logs", quarantine=quarantine)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"{exc}. {pinned.read_failure_hint(repo, data_rev, data_path)}") from exc
        mlflow.set_tag("dvc_md5", md5)
        mlflow.MlflowClient().set_tag(parent_run_id, "dvc_md5", md5)
        mlflow.MlflowClient().set_tag(parent_run_id, "data_path", data_path)
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
    return episodes, md5, len(quarantine or [])


@task(name="dagger", timeout_seconds=6 * 3600, cache_policy=NO_CACHE)
def dagger_task(policy: str, cfg: PipelineConfig, repo: str, tag: str, num_games: int, game_offset: int,
                workers: int, parent_run_id: str) -> dict:
    """Play ``num_games`` train games (evenly spaced from ``game_offset``) with ``policy``, the handcoded expert
    labelling each state (``evoharness.data.dagger``), into the DVC-tracked folder ``data-dagger-<tag>/``; ``dvc add``
    and push it. A folder whose logs its ``.dvc`` file already names is kept as it is (``status`` present); a killed
    collection resumes. Logs the policy, the games and the agreement with the expert to MLflow."""
    from evoharness.data.dagger import collect_dagger
    from evoharness.evaluation.evaluate import spread

    log = get_run_logger()
    path = f"data-dagger-{tag}"
    folder, dvc_file = Path(repo) / path, Path(repo) / f"{path}.dvc"
    ev = cfg.evaluate
    games = spread(list_games("train", offset=game_offset), num_games)
    with start_run("dagger", parent_run_id, tags={"policy": policy, "model_uri": policy, "data_path": path}):
        mlflow.log_params({"dagger.policy": policy, "dagger.tag": tag, "dagger.num_games": num_games,
                           "dagger.game_offset": game_offset, **{f"evaluate.{k}": v for k, v in ev.__dict__.items()}})
        committed = rawlog.dvc_md5(repo, dvc_file=dvc_file.name)
        if committed and not (folder / f"dagger-{tag}.json").exists() and not datastore.restore(repo, path):
            raise FileNotFoundError(
                f"{dvc_file.name} names DAgger logs (md5 {committed}) that neither the DVC cache nor the default "
                f"remote holds, and a policy's play is not regenerated behind your back: restore them (`dvc pull "
                f"{path}`), or collect a new version with another --tag")
        if committed:
            md5 = datastore.add_checked(repo, path, committed, f"{folder}/ (the DAgger logs there now)",
                                        f"Restore it with `dvc checkout {path}`, or use another --tag.")
            status, manifest = "present", json.loads((folder / f"dagger-{tag}.json").read_text())
            if manifest["settings"]["policy"] != policy or manifest["games"] != games:
                raise ValueError(f"{path}/ holds {manifest['episodes']} episodes of {manifest['settings']['policy']}, "
                                 f"not {len(games)} of {policy}: use another --tag")
        else:
            manifest = collect_dagger(
                policy, games, folder, ev, cfg.cost, tag, workers, workspace_cfg=cfg.traces,
                progress=log.info)
            shutil.rmtree(folder / "model_cache", ignore_errors=True)
            md5, status = datastore.dvc_add(repo, path), "collected"
            mlflow.log_metrics({"wall_s": manifest["wall_s"], "resumed": manifest["resumed"],
                                "episodes_per_min": (manifest["episodes"] - manifest["resumed"])
                                / max(manifest["wall_s"], 1e-9) * 60})
        mlflow.log_metrics({k: manifest[k] for k in ("episodes", "won", "steps", "labelled_steps", "agreement")})
        mlflow.set_tags({"dvc_md5": md5, "data_status": status})
        pushed = datastore.dvc_push(repo, path) if datastore.default_remote(repo) else None
    log.info(f"DAgger logs {status} in {path}/: {manifest['episodes']} episodes of {policy}, "
             f"{manifest['labelled_steps']} expert-labelled steps, agreement {manifest['agreement']:.3f}, md5 {md5}")
    return {"status": status, "path": path, "md5": md5, "pushed": pushed, "episodes": manifest["episodes"],
            "won": manifest["won"], "labelled_steps": manifest["labelled_steps"], "agreement": manifest["agreement"]}


def set_parent_tags(run_id: str, tags: dict) -> None:
    """Tag the pipeline's parent run (the aggregated data's md5 and paths, after the per-folder ingests)."""
    client = mlflow.MlflowClient()
    for k, v in tags.items():
        client.set_tag(run_id, k, v)


def log_parent_metrics(run_id: str, metrics: dict) -> None:
    """Log metrics on the pipeline's parent run (totals over the per-folder ingests, e.g. quarantined records)."""
    client = mlflow.MlflowClient()
    for k, v in metrics.items():
        client.log_metric(run_id, k, v)
