"""The main flow: DVC-tracked logs -> BPE traces -> SFT -> cost-aware GRPO -> evaluation -> registered policy.

    python -m flows.pipeline [--profile NAME] [--data-rev REV] [--split NAME] [--limit N] [--summary-json FILE]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from prefect import flow

from evoharness.config import load_profile
from evoharness.report import pipeline_summary, print_summary, write_summary
from tasks.caching import run_stage
from tasks.data import collect_task, ingest_task
from tasks.evaluation import evaluate_task, promote_task, register_task
from tasks.run import pipeline_run
from tasks.traces import build_traces_task
from tasks.training import grpo_task, sft_task

REPO = str(Path(__file__).resolve().parent.parent)


@flow(name="evoharness-pipeline")
def pipeline(profile: str = "default", data_rev: str | None = None, split: str | None = None,
             limit: int | None = None, summary_json: str | None = None, repo: str = REPO) -> dict:
    """Run every stage once (cached stages are reused); returns the summary, also written to ``summary_json``."""
    cfg = load_profile(profile, {"evaluate": {k: v for k, v in (("split", split), ("limit", limit)) if v is not None}})
    runs = str(Path(repo) / "runs")
    evals = str(Path(runs) / "eval" / time.strftime(f"%Y%m%d-%H%M%S-{cfg.profile}"))
    walls, cached, t = {}, {}, time.time()

    def lap(stage: str, was_cached: bool = False) -> None:
        nonlocal t
        walls[stage], cached[stage], t = time.time() - t, was_cached, time.time()

    with pipeline_run("pipeline", cfg, repo, data_rev) as parent:
        pid = parent.info.run_id
        data = collect_task(cfg, repo, pid)
        lap("collect")
        episodes, md5 = ingest_task(repo, data_rev, pid, cfg.ingest.on_error)
        lap("ingest")
        traces, hit = run_stage(build_traces_task, episodes, md5, cfg, runs, pid)
        lap("build_traces", hit)
        sft, hit = run_stage(sft_task, cfg, traces, runs, pid)
        lap("sft", hit)
        grpo, hit = run_stage(grpo_task, cfg, sft, traces, runs, pid)
        lap("grpo", hit)
        lineage = {"data_rev": data_rev or "workspace", "dvc_md5": md5, "trace_hash": traces["content_hash"],
                   "trace_run_id": traces["run_id"], "parent_model_run_id": sft["run_id"],
                   "grpo_run_id": grpo["run_id"], "pipeline_run_id": pid, "config_digest": cfg.digest(),
                   **{k: parent.data.tags[k] for k in ("git_commit", "git_dirty", "profile",
                                                       "prefect_flow_run_id", "prefect_deployment_id")}}
        model = register_task(grpo["final_path"], cfg.registered_model_name, lineage, cfg.to_dict(), traces, pid)
        lap("register")
        ev = evaluate_task(grpo["final_path"], cfg.evaluate, cfg.cost, evals, pid, grpo["experience_path"],
                           model["model_uri"], workspace_cfg=cfg.traces)
        parent_ev = evaluate_task(sft["final_path"], cfg.evaluate, cfg.cost, evals, pid, traces["experience_path"],
                                  f"runs:/{sft['run_id']}", name=f"evaluate-parent-{cfg.evaluate.split}",
                                  parent_of=model["model_uri"], workspace_cfg=cfg.traces)
        lap("evaluate")
        decision = promote_task(model, cfg.registered_model_name, ev, cfg.evaluate, cfg.cost, evals, pid)
        lap("promote")
        summary = pipeline_summary(ev, parent_ev, model, grpo, sft, traces, data, walls, cached, decision, pid,
                                   lineage)
    print_summary(summary)
    if summary_json:
        write_summary(summary, summary_json)
    return summary


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description="Run the EvoHarness pipeline on the embedded default model.")
    p.add_argument("--profile", default="default", help="profiles/<NAME>.yaml (default: default)")
    p.add_argument("--data-rev", default=None, help="git rev whose data.dvc names the logs (default: workspace)")
    p.add_argument("--split", default=None, help="evaluation split (default: the profile's, valid_seen)")
    p.add_argument("--limit", type=int, default=None, help="evaluate N games evenly spaced over the split (0 = all)")
    p.add_argument("--summary-json", default=None, help="write the summary JSON here")
    a = p.parse_args(argv)
    return pipeline(profile=a.profile, data_rev=a.data_rev, split=a.split, limit=a.limit, summary_json=a.summary_json)


if __name__ == "__main__":
    main()
