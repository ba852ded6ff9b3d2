"""Prefect task: BPE trace construction."""

from __future__ import annotations

import json
from pathlib import Path

from mlflow.data.meta_dataset import MetaDataset
from mlflow.data.sources import LocalArtifactDatasetSource
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

import mlflow
from evoharness.config import PipelineConfig
from evoharness.traces import build_traces
from evoharness.tracking import start_run


@task(name="build_traces", timeout_seconds=3600, cache_policy=NO_CACHE)
def build_traces_task(episodes: list, md5: str, cfg: PipelineConfig, work_dir: str, parent_run_id: str) -> dict:
    """Annotate the episodes with meta-actions; log the trace dataset (content hash as MLflow dataset digest)."""
    out = Path(work_dir) / "traces"
    with start_run("build_traces", parent_run_id, tags={"dvc_md5": md5}):
        stats = build_traces(episodes, cfg.traces, out, experience_path=out / "experience.db")
        mlflow.set_tag("trace_hash", stats["content_hash"])
        mlflow.MlflowClient().set_tag(parent_run_id, "trace_hash", stats["content_hash"])
        mlflow.log_params({f"traces.{k}": v for k, v in cfg.traces.__dict__.items()})
        mlflow.log_metrics({"episodes": stats["episodes"], "kept": stats["kept"], "steps": stats["steps"],
                            "lessons": stats["lessons"], **{f"meta_actions_per_episode.{k}": v
                                                            for k, v in stats["meta_actions_per_episode"].items()}})
        dataset = MetaDataset(
            source=LocalArtifactDatasetSource(str(out / "train.jsonl")),
            name="bpe-traces", digest=stats["content_hash"][:16])
        mlflow.log_input(dataset, context="training")
        first = (out / "train.jsonl").read_text().splitlines()[:1]
        if first:
            mlflow.log_text(json.dumps(json.loads(first[0]), indent=1), "example_trace.json")
    get_run_logger().info(f"traces: {stats['train_rows']} train / {stats['valid_rows']} valid rows, "
                          f"hash {stats['content_hash'][:12]}")
    return {"dir": str(out), "train_file": str(out / "train.jsonl"), "valid_file": str(out / "valid.jsonl"),
            "experience_path": str(out / "experience.db"), **stats}
