"""The pipeline's parent MLflow run: opened around a flow run, tagged with its lineage."""

from __future__ import annotations

import contextlib
import json
import time

import mlflow

from evoharness.config import PipelineConfig
from evoharness.registry.tracking import configure, git_info, start_run


@contextlib.contextmanager
def pipeline_run(name: str, cfg: PipelineConfig, repo: str, data_rev: str | None):
    """Configure the embedded MLflow store and hold one parent run (yielded) for the whole flow run.

    Like every stage run it records its process, and first closes as KILLED the runs of the same name, and their
    stage runs, left RUNNING by a killed flow (``evoharness.registry.tracking.start_run``).

    Tags: git commit and dirty flag, profile, data rev, Prefect flow-run and deployment ids. The resolved config
    is logged as ``config.json``.
    """
    from prefect.runtime import deployment, flow_run

    configure(repo)
    tags = {
        **git_info(repo),
        "profile": cfg.profile,
        "data_rev": data_rev or "workspace",
        "prefect_flow_run_id": str(flow_run.id or ""),
        "prefect_deployment_id": str(deployment.id or ""),
    }
    with start_run(name, tags=tags) as run:
        mlflow.log_dict(cfg.to_dict(), "config.json")
        mlflow.log_param("config", json.dumps(cfg.to_dict())[:6000])
        yield run


class StageClock:
    """Wall seconds of each pipeline stage, and whether Prefect served it from its cache: ``lap(stage)`` closes the
    stage that ran since the previous lap. ``walls`` and ``cached`` are the summary's ``stage_wall_s`` and
    ``stage_cached``."""

    def __init__(self) -> None:
        self.walls: dict[str, float] = {}
        self.cached: dict[str, bool] = {}
        self._t = time.time()

    def lap(self, stage: str, was_cached: bool = False) -> None:
        now = time.time()
        self.walls[stage], self.cached[stage], self._t = now - self._t, was_cached, now
