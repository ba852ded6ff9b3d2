"""The main flow: DVC-tracked logs -> BPE traces -> SFT -> cost-aware GRPO -> evaluation -> registered policy.

    python -m flows.pipeline [--profile NAME] [--data-rev REV] [--split NAME] [--limit N] [--until sft|grpo]
                             [--summary-json FILE] [SECTION.FIELD=VALUE ...]

``--until sft`` stops training after SFT: the SFT policy is registered (alias ``candidate``), evaluated and
considered for ``champion``, with no GRPO stage.

With ``model.from_champion`` (the ``default`` profile: the retraining job platform teams schedule) the run starts
from the registered ``champion``, or from the release in ``model.path`` when the registry has none: it fine-tunes
that policy briefly on the newly collected traces, runs cost-aware GRPO, evaluates the candidate and its parent on
the same games (the parent's recorded outcomes reused when recorded with the same settings), prints both with an
exact paired test, and moves ``champion`` only to a candidate that is not worse and reaches
``promote.min_success``.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import yaml
from prefect import flow

from evoharness.config import load_profile, parse_overrides
from evoharness.data.rawlog import dagger_policy
from evoharness.evaluation.report import pipeline_summary, print_summary, write_summary
from evoharness.evaluation.stats import mcnemar_exact
from evoharness.registry.lineage import pipeline_lineage
from tasks.caching import run_stage
from tasks.data import collect_task, ingest_task, log_parent_metrics, set_parent_tags
from tasks.evaluation import (
    evaluate_task,
    parent_evaluation,
    promote_task,
    register_task,
    start_policy_task,
)
from tasks.run import StageClock, pipeline_run
from tasks.traces import build_traces_task
from tasks.training import grpo_task, sft_from_model_task, sft_task

REPO = str(Path(__file__).resolve().parent.parent)


@flow(name="evoharness-pipeline")
def pipeline(profile: str = "default", data_rev: str | None = None, split: str | None = None,
             limit: int | None = None, summary_json: str | None = None, repo: str = REPO,
             until: str = "grpo", sft_model: str | None = None, overrides: list[str] | None = None) -> dict:
    """Run every stage once (cached stages are reused); returns the summary, also written to ``summary_json``.

    ``until``: ``grpo`` (every stage) or ``sft`` (no GRPO: the SFT policy is the candidate). Raises ValueError
    for another value. ``sft_model``: a registered version (``models:/NAME@ALIAS``) or folder to start GRPO from
    instead of training SFT (the data and trace stages still run: GRPO starts from their Experience store).
    ``overrides``: ``SECTION.FIELD=VALUE`` strings applied on top of the profile
    (``evoharness.config.parse_overrides``);
    ``split`` and ``limit`` are ``evaluate.split`` and ``evaluate.limit``."""
    if until not in ("sft", "grpo"):
        raise ValueError(f"until is {until!r}; use 'sft' or 'grpo'")
    if sft_model and until != "grpo":
        raise ValueError(f"--sft-model {sft_model} skips SFT training: it only makes sense with --until grpo")
    cfg = load_profile(profile, resolve_overrides(overrides, split, limit))
    runs = str(Path(repo) / "runs")
    evals = str(Path(runs) / "eval" / time.strftime(f"%Y%m%d-%H%M%S-{cfg.profile}"))
    clock = StageClock()
    with pipeline_run("pipeline", cfg, repo, data_rev) as parent:
        pid = parent.info.run_id
        start = None
        if cfg.model.from_champion and not sft_model:  # retrain the champion (or the release) on the new data
            release = cfg.model.path if Path(cfg.model.path).is_absolute() else str(Path(repo) / cfg.model.path)
            start = start_policy_task(cfg.registered_model_name, release, runs, cfg.promote.min_success, pid)
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=start["path"]))
        data = collect_task(cfg, repo, pid, data_rev)
        clock.lap("collect")
        episodes, md5, quarantined = ingest_task(repo, data_rev, pid, cfg.ingest.on_error, cfg.collect.path)
        data_paths, dagger_policies = [cfg.collect.path], {}
        for path in cfg.ingest.dagger:  # DAgger: aggregate expert-labelled policy episodes with the expert logs
            more, more_md5, more_quarantined = ingest_task(repo, data_rev, pid, cfg.ingest.on_error, path)
            episodes, md5, quarantined = episodes + more, f"{md5}+{more_md5}", quarantined + more_quarantined
            data_paths.append(path)
            dagger_policies[path] = dagger_policy(repo, data_rev, path)
        if cfg.ingest.dagger:
            set_parent_tags(pid, {"dvc_md5": md5, "data_path": "+".join(data_paths)})
        log_parent_metrics(pid, {"quarantined_records": quarantined})
        clock.lap("ingest")
        traces, hit = run_stage(build_traces_task, episodes, md5, cfg, runs, pid)
        clock.lap("build_traces", hit)
        if sft_model:
            sft, hit = sft_from_model_task(sft_model, runs), False
        else:
            sft, hit = run_stage(sft_task, cfg, traces, runs, pid)
        clock.lap("sft", hit)
        grpo, start_exp = None, (start or {}).get("experience_path")
        if until == "grpo":  # GRPO recalls from the Experience store of the policy it starts from
            exp = start_exp or sft.get("experience_path") or traces["experience_path"]
            grpo, hit = run_stage(grpo_task, cfg, sft, traces | {"experience_path": exp}, runs, pid)
            clock.lap("grpo", hit)
        final = grpo or {"final_path": sft["final_path"], "experience_path": start_exp or traces["experience_path"]}
        lineage = pipeline_lineage(data_rev=data_rev, md5=md5, data_path="+".join(data_paths),
                                   dagger_policies=dagger_policies, traces=traces, sft=sft, grpo=grpo, start=start,
                                   sft_model=sft_model, until=until, config_digest=cfg.digest(),
                                   pipeline_run_id=pid, run_tags=parent.data.tags)
        model = register_task(final["final_path"], cfg.registered_model_name, lineage, cfg.to_dict(), traces, pid,
                              final["experience_path"])
        clock.lap("register")
        ev = evaluate_task(final["final_path"], cfg.evaluate, cfg.cost, evals, pid, final["experience_path"],
                           model["model_uri"], workspace_cfg=cfg.traces)
        parent_ev = parent_evaluation(cfg, start, sft, sft_model, grpo, traces, evals, pid, model["model_uri"])
        clock.lap("evaluate")
        decision = promote_task(model, cfg.registered_model_name, ev, cfg.evaluate, cfg.cost, evals, pid,
                                workspace_cfg=cfg.traces, min_success=cfg.promote.min_success)
        clock.lap("promote")
        summary = pipeline_summary(ev, parent_ev, model, grpo, sft, traces, data, clock.walls, clock.cached, decision,
                                   pid, lineage, ingest={"on_error": cfg.ingest.on_error,
                                                         "quarantined_records": quarantined})
        # where this run's policy, lessons and evaluation lie (``python -m evoharness.registry.release export``)
        summary["paths"] = {"final_path": final["final_path"], "experience_path": final["experience_path"],
                            "transcripts": ev.get("transcripts"), "sft_dir": str(Path(sft["final_path"]).parent)}
        if parent_ev is not None:  # candidate (a) against its parent (b) on the same games
            summary["paired_test"] = mcnemar_exact(ev["won_by_game"], parent_ev["won_by_game"])
            summary["parent_model_uri"] = (start or {}).get("model_uri") or sft.get("model_uri") or sft["final_path"]
    print_summary(summary)
    if summary_json:
        write_summary(summary, summary_json)
    return summary


def resolve_overrides(overrides: list[str] | None, split: str | None, limit: int | None) -> dict:
    """The profile overrides of a run: the ``SECTION.FIELD=VALUE`` strings, then ``--split`` and ``--limit``."""
    over = parse_overrides(overrides or [])
    over["evaluate"] = {**over.get("evaluate", {}),
                        **{k: v for k, v in (("split", split), ("limit", limit)) if v is not None}}
    return over


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description="Run the EvoHarness pipeline (profile default: retrain the champion).",
                                epilog="Any config field can be set after the flags: python -m flows.pipeline "
                                       "--profile full sft.learning_rate=1e-3 evaluate.limit=20")
    p.add_argument("--profile", default="default", help="profiles/<NAME>.yaml (default: default)")
    p.add_argument("--data-rev", default=None,
                   help="git rev whose <collect.path>.dvc names the logs (default: workspace)")
    p.add_argument("--split", default=None, help="evaluation split (default: the profile's, valid_seen)")
    p.add_argument("--limit", type=int, default=None, help="evaluate N games evenly spaced over the split (0 = all)")
    p.add_argument("--until", default="grpo", choices=["sft", "grpo"], help="last training stage (default: grpo)")
    p.add_argument("--summary-json", default=None, help="write the summary JSON here")
    p.add_argument("--sft-model", default=None,
                   help="start GRPO from this model (models:/NAME@ALIAS, models:/NAME/VERSION or a folder) instead "
                        "of training SFT")
    p.add_argument("overrides", nargs="*", metavar="SECTION.FIELD=VALUE",
                   help="set any config field on top of the profile, e.g. sft.learning_rate=1e-3")
    a = p.parse_args(argv)
    # a profile typo or a bad value is a usage error: said now, before any Prefect server starts (exit status 2)
    if a.sft_model and a.until != "grpo":
        p.error(f"--sft-model {a.sft_model} skips SFT training: it only makes sense with --until grpo")
    try:
        load_profile(a.profile, resolve_overrides(a.overrides, a.split, a.limit))
    except (OSError, ValueError, yaml.YAMLError) as exc:
        p.error(str(exc))  # the message, no traceback
    return pipeline(profile=a.profile, data_rev=a.data_rev, split=a.split, limit=a.limit, summary_json=a.summary_json,
                    until=a.until, sft_model=a.sft_model, overrides=a.overrides)


if __name__ == "__main__":
    main()
