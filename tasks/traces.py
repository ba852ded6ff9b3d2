"""Prefect task: BPE trace construction."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
from prefect import get_run_logger, task

from evoharness.config import PipelineConfig
from evoharness.harness.traces import build_traces
from evoharness.registry.tracking import log_trace_dataset, start_run
from tasks.caching import content_key, stage_policy

# the library code the stage runs: its cache key covers these and their imports
TRACES_CODE = ("evoharness.harness.traces",)


def traces_dir(p: dict) -> Path:
    """``runs/traces/<key>``: keyed on the data md5 and the trace settings."""
    return Path(p["work_dir"]) / "traces" / content_key(TRACES_CODE, p["md5"], p["cfg"].traces, p["work_dir"])


@task(name="build_traces", timeout_seconds=3600, cache_policy=stage_policy(traces_dir), persist_result=True)
def build_traces_task(episodes: list, md5: str, cfg: PipelineConfig, work_dir: str, parent_run_id: str) -> dict:
    """Annotate the episodes with meta-actions; log the trace dataset (content hash as MLflow dataset digest).

    Cached on (data md5, trace settings, task source) while its output folder exists."""
    out = traces_dir({"md5": md5, "cfg": cfg, "work_dir": work_dir})
    with start_run("build_traces", parent_run_id, tags={"dvc_md5": md5}) as run:
        stats = build_traces(episodes, cfg.traces, out, experience_path=out / "experience.db")
        mlflow.set_tag("trace_hash", stats["content_hash"])
        mlflow.MlflowClient().set_tag(parent_run_id, "trace_hash", stats["content_hash"])
        mlflow.log_params({f"traces.{k}": v for k, v in cfg.traces.__dict__.items()})
        mlflow.log_metrics(
            {
                "episodes": stats["episodes"],
                "kept": stats["kept"],
                "steps": stats["steps"],
                "lessons": stats["lessons"],
                **{f"meta_actions_per_episode.{k}": v for k, v in stats["meta_actions_per_episode"].items()},
            }
        )
        log_trace_dataset(str(out / "train.jsonl"), stats["content_hash"])
        mlflow.log_metrics({k: v for k, v in stats.items() if k.endswith(("_mean", "_max"))})
        for i, line in enumerate((out / "train.jsonl").read_text().splitlines()[:3]):
            mlflow.log_text(json.dumps(json.loads(line), indent=1), f"example_traces/trace_{i}.json")
    get_run_logger().info(
        f"traces: {stats['kept']} of {stats['episodes']} episodes kept (lost expert episodes are left out), "
        f"{stats['train_rows']} train / {stats['valid_rows']} valid rows, hash {stats['content_hash'][:12]}"
    )
    result = {
        "dir": str(out),
        "train_file": str(out / "train.jsonl"),
        "valid_file": str(out / "valid.jsonl"),
        "experience_path": str(out / "experience.db"),
        "run_id": run.info.run_id,
        **stats,
    }
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return result
