"""Prefect tasks: evaluation on a split, model logging + registration with lineage, and promotion."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from evoharness.config import CostConfig, EvalConfig, TraceConfig
from evoharness.env.alfworld import list_games
from evoharness.evaluation.evaluate import evaluate, spread
from evoharness.evaluation.workers import play_shard_in_subprocess
from evoharness.registry.promotion import (
    alias_version,
    experience_of,
    link_evaluation,
    link_parent_evaluation,
    parse_model_uri,
    promote,
    recorded_evaluation_tag,
)
from evoharness.registry.release import ReleaseError, is_release, read_release, record_evaluation, register_release
from evoharness.registry.tracking import flat, log_and_register, log_trace_dataset, start_run
from tasks.caching import RETRY, transient_only


@task(name="evaluate-shard", cache_policy=NO_CACHE)
def evaluate_shard_task(job: list) -> tuple[list[dict], dict]:
    """One evaluation shard (its games played into its own folder) as a Prefect task, run by a worker of the flow's
    task runner, in a child process of that worker with the expert's hash seed
    (``evoharness.evaluation.workers.play_shard_in_subprocess``)."""
    return play_shard_in_subprocess(tuple(job))


@flow(name="evaluate-shards")
def evaluate_shards_flow(jobs: list) -> list:
    """Submit every shard to this flow's task runner at once and return their results in job order."""
    futures = [evaluate_shard_task.submit(job) for job in jobs]
    return [f.result() for f in futures]


def shard_runner(cfg: EvalConfig):
    """``run_shards`` for ``evoharness.evaluation.evaluate.evaluate`` under ``cfg.task_runner``: None (a local process
    pool)
    for ``processes``; for ``dask``, the shards as Prefect tasks on ``prefect_dask.DaskTaskRunner``: a local
    cluster of ``cfg.workers`` single-threaded worker processes, or the cluster at ``cfg.dask_address``."""
    if cfg.task_runner != "dask":
        return None
    from prefect_dask import DaskTaskRunner

    runner = (DaskTaskRunner(address=cfg.dask_address) if cfg.dask_address else DaskTaskRunner(
        cluster_kwargs={"n_workers": cfg.workers, "threads_per_worker": 1, "processes": True,
                        "dashboard_address": None}))
    return lambda jobs: evaluate_shards_flow.with_options(task_runner=runner)([list(j) for j in jobs])


@task(
    name="evaluate",
    **RETRY,
    timeout_seconds=6 * 3600,
    cache_policy=NO_CACHE,
)
def evaluate_task(
    policy: str,
    cfg: EvalConfig,
    cost: CostConfig,
    work_dir: str,
    parent_run_id: str | None,
    experience_path: str | None = None,
    model_uri: str | None = None,
    name: str | None = None,
    parent_of: str | None = None,
    workspace_cfg: TraceConfig | None = None,
) -> dict:
    """Play ``cfg.limit`` evenly spaced games of ``cfg.split`` (0 = all) with ``policy``; log the summary to a
    (nested) run, and link the run to the registered version when ``model_uri`` names one. ``parent_of``: a
    registered version whose parent this policy is; its ``parent_evaluation_run_id`` tag gets this run."""
    log = get_run_logger()
    all_games = list_games(cfg.split)
    games = spread(all_games, cfg.limit)
    name = name or f"evaluate-{cfg.split}"
    out = Path(work_dir) / name
    with start_run(
        name, parent_run_id, tags={"policy": policy, "split": cfg.split, "model_uri": model_uri or policy}
    ) as run:
        mlflow.log_params({f"evaluate.{k}": v for k, v in cfg.__dict__.items()})
        summary = evaluate(
            policy,
            games,
            cfg,
            cost,
            out,
            experience_path,
            games_total=len(all_games),
            progress=log.info,
            workspace_cfg=workspace_cfg,
            identity=model_uri or policy,
            run_shards=shard_runner(cfg),
        )
        mlflow.log_metrics(flat("", {k: v for k, v in summary.items() if k not in ("errors", "won_by_game")}))
        mlflow.log_dict(summary | {"games": games}, "summary.json")
        mlflow.log_artifact(str(out / "transcripts.jsonl"))
        summary["mlflow_run_id"] = run.info.run_id
    link_evaluation(model_uri or policy, cfg.split, games, summary["success_rate"], run.info.run_id)
    if parent_of:
        link_parent_evaluation(parent_of, run.info.run_id)
    summary["games"] = games
    summary["transcripts"] = str(out / "transcripts.jsonl")
    log.info(f"{name}: success {summary['success_rate']:.3f} over {summary['episodes']} episodes")
    if summary["environment_failures"]:
        flags = "" if cfg.act_each_turn else " --meta-only-turns"
        flags += " --ground-track" if cfg.ground_track else " --no-ground-track"
        again = (f"python -m flows.evaluate --policy {model_uri or policy} --split {cfg.split} --limit {cfg.limit} "
                 f"--decoding {cfg.decoding} --workers {cfg.workers}{flags} --work-dir {work_dir} "
                 "--profile <the same profile>"
                 if name == f"evaluate-{cfg.split}" else f"this task again into {out} (same policy and settings)")
        log.warning(f"{name}: {summary['environment_failures']} of {summary['episodes']} episodes did not run (the "
                    f"environment failed: see 'errors'); they count as lost. Replay only them with: {again}")
    return summary


def recorded_evaluation(model_uri: str, cfg: EvalConfig) -> dict | None:
    """The summary of an evaluation already recorded on the registered version ``model_uri`` for the same split,
    the same games and the same evaluation settings (every ``evaluate.*`` parameter equal); None when there is none.
    Lets a pipeline started from a registered SFT model (``--sft-model``) compare against it without replaying the
    split."""
    from mlflow import MlflowClient

    parsed = parse_model_uri(model_uri)
    if parsed is None:
        return None
    games = spread(list_games(cfg.split), cfg.limit)
    run_id = recorded_evaluation_tag(*parsed, cfg.split, games, "run_id")
    if run_id is None:
        return None
    params = MlflowClient().get_run(run_id).data.params
    implicit = {k: str(v) for k, v in cfg.IMPLICIT.items()}  # not logged by runs older than the field
    if any(params.get(f"evaluate.{k}", implicit.get(k)) != str(v) for k, v in cfg.__dict__.items()
           if k not in cfg.OPERATIONAL):
        return None
    summary = mlflow.artifacts.load_dict(f"runs:/{run_id}/summary.json")
    get_run_logger().info(f"{model_uri}: reusing its evaluation run {run_id} on {cfg.split} ({len(games)} games)")
    return summary | {"mlflow_run_id": run_id, "games": games}


@task(
    name="register",
    **RETRY,
    timeout_seconds=1800,
    cache_policy=NO_CACHE,
)
def register_task(
    model_path: str, registered_name: str, lineage: dict, config: dict, trace_dataset: dict, parent_run_id: str,
    experience_path: str | None = None,
) -> dict:
    """Log the final policy, register it under ``registered_name`` with alias ``candidate``, lineage tags, the
    resolved config and the trace dataset as the run's MLflow dataset input. ``experience_path``: the Experience
    store it plays with, logged beside it (version tag ``experience_artifact``), so that a later run starting from
    this version, or evaluating it, recalls the same lessons."""
    with start_run("register", parent_run_id, tags=lineage):
        mlflow.log_dict(config, "config.json")
        log_trace_dataset(trace_dataset["train_file"], trace_dataset["content_hash"])
        tags = dict(lineage)
        if experience_path and Path(experience_path).is_file():
            mlflow.log_artifact(experience_path, "experience")
            tags["experience_artifact"] = f"experience/{Path(experience_path).name}"
        info = log_and_register(model_path, registered_name, "candidate", tags)
    get_run_logger().info(f"registered {info['model_uri']} (alias candidate)")
    return info


@task(name="promote", retries=1, retry_condition_fn=transient_only, timeout_seconds=6 * 3600, cache_policy=NO_CACHE)
def promote_task(
    model: dict,
    registered_name: str,
    evaluation: dict,
    cfg: EvalConfig,
    cost: CostConfig,
    work_dir: str,
    parent_run_id: str,
    workspace_cfg: TraceConfig | None = None,
    min_success: float = 0.0,
) -> dict:
    """Move ``champion`` to the candidate when its success on the same split and games is at least the
    champion's (the champion is evaluated on them first if needed) and at least ``min_success``
    (``promote.min_success``); log the comparison."""
    log = get_run_logger()
    with start_run("promote", parent_run_id) as run:

        def evaluate_champion(version: str) -> float:
            uri = f"models:/{registered_name}/{version}"
            summary = evaluate_task.fn(
                uri, cfg, cost, work_dir, run.info.run_id, model_uri=uri, name=f"evaluate-champion-v{version}",
                workspace_cfg=workspace_cfg,
                experience_path=experience_of(uri, str(Path(work_dir) / f"champion-v{version}")),
            )
            return summary["success_rate"]

        decision = promote(registered_name, model["version"], cfg.split, evaluation["games"], evaluate_champion,
                           min_success)
        mlflow.log_dict(decision, "comparison.json")
        mlflow.set_tags(
            {"promoted": str(decision["promoted"]).lower(), "split": cfg.split, "games_sha": decision["games_sha"]}
        )
        mlflow.log_metrics({k: v for k, v in decision.items() if isinstance(v, float)})
        decision["run_id"] = run.info.run_id
    champ_rate = decision["champion_success_rate"]
    champion = ("no champion yet" if decision["champion_version"] is None else
                f"champion v{decision['champion_version']}" + (f" {champ_rate:.3f}" if champ_rate is not None else ""))
    log.info(f"promotion: candidate v{decision['candidate_version']} {decision['candidate_success_rate']:.3f} vs "
             f"{champion} -> {'promoted' if decision['promoted'] else 'kept champion'} ({decision['reason']})")
    return decision


@task(name="start-policy", **RETRY, timeout_seconds=1800, cache_policy=NO_CACHE)
def start_policy_task(registered_name: str, release: str, work_dir: str, min_success: float,
                      parent_run_id: str | None = None) -> dict:
    """The policy a retraining run starts from (``model.from_champion``): the registered ``champion`` of
    ``registered_name``, or, when the registry has none, the release folder ``release``, registered now and made
    champion when its recorded success reaches ``min_success``.

    Returns ``model_uri`` (the pinned version), ``path`` (what SFT loads: the release folder or the URI),
    ``experience_path`` (the Experience store it plays with, or None), ``source`` (``champion`` or ``release``) and
    ``release`` (the folder, or None). Raises ReleaseError when there is no champion and ``release`` is not a
    release folder."""
    log = get_run_logger()
    version = alias_version(registered_name, "champion")
    if version is not None:
        uri = f"models:/{registered_name}/{version}"
        tags = mlflow.MlflowClient().get_model_version(registered_name, version).tags
        folder = tags.get("release_path") if tags.get("release") else None
        folder = folder if folder and is_release(folder) else None
        exp = experience_of(uri, str(Path(work_dir) / "start" / f"v{version}"))
        log.info(f"starting from the champion {uri}" + (f" (release {folder})" if folder else ""))
        return {"model_uri": uri, "path": folder or uri, "experience_path": exp, "source": "champion",
                "release": folder}
    if not is_release(release):
        raise ReleaseError(f"model.path {release!r}: no champion is registered under {registered_name!r} and this "
                           f"is not a release folder (one with release.json, e.g. models/evoharness-full-sft)")
    release = str(Path(release).resolve())
    info = register_release(release, registered_name, parent_run_id)
    rel = read_release(release)
    split = next(iter(rel["evaluations"]))
    recorded = json.loads((Path(release) / rel["evaluations"][split]).read_text())["success_rate"]
    if recorded >= min_success:
        mlflow.MlflowClient().set_registered_model_alias(registered_name, "champion", info["version"])
    log.info(f"no champion under {registered_name!r}: registered the release {release} as {info['model_uri']} "
             f"({split} {recorded:.3f}; "
             f"{'champion' if recorded >= min_success else 'below promote.min_success, not champion'})")
    return {"model_uri": info["model_uri"], "path": release, "experience_path": str(Path(release) / "experience.db"),
            "source": "release", "release": release}


@task(name="parent-evaluation", **RETRY, timeout_seconds=1800, cache_policy=NO_CACHE)
def release_parent_evaluation(start: dict, registered_name: str, cfg: EvalConfig,
                              parent_run_id: str | None = None) -> dict | None:
    """The parent's outcomes on the games ``cfg`` evaluates, taken from its release's recorded evaluation when the
    release played with the same settings (``release.json``'s ``evaluate`` equal to ``cfg`` but for ``split`` and
    ``limit``; ``evoharness.registry.release.record_evaluation``), else None (the parent is then evaluated)."""
    if not start.get("release") or not _recorded_alike(start["release"], cfg):
        return None
    version = start["model_uri"].rsplit("/", 1)[1]
    summary = record_evaluation(start["release"], registered_name, version, cfg.split, cfg.limit, parent_run_id)
    get_run_logger().info(f"parent {start['model_uri']}: its {cfg.split} outcomes on these {len(summary['games'])} "
                          f"games are the release's recorded ones ({summary['recorded_in']})")
    return summary


def release_folder_evaluation(path: str, cfg: EvalConfig, parent_run_id: str | None = None) -> dict | None:
    """The outcomes of the release folder ``path`` (``--sft-model models/...``) on the games ``cfg`` evaluates, from
    its recorded evaluation when it played with the same settings (as ``release_parent_evaluation``), recorded as an
    MLflow run under ``parent_run_id``; None when ``path`` is not a release or played otherwise (it is then
    evaluated)."""
    if not is_release(path) or not _recorded_alike(path, cfg):
        return None
    summary = record_evaluation(path, None, None, cfg.split, cfg.limit, parent_run_id)
    get_run_logger().info(f"parent {path}: its {cfg.split} outcomes on these {len(summary['games'])} games are the "
                          f"release's recorded ones ({summary['recorded_in']})")
    return summary


def _recorded_alike(release: str, cfg: EvalConfig) -> bool:
    """Whether the release recorded an evaluation of ``cfg.split`` with ``cfg``'s settings (``split`` and ``limit``
    aside: a subset of its games is taken)."""
    rel = read_release(release)
    mine = {k: v for k, v in cfg.__dict__.items() if k not in ("split", "limit")}
    if {k: rel["evaluate"].get(k) for k in mine} != mine or cfg.split not in rel["evaluations"]:
        get_run_logger().info(f"{release} recorded its evaluation with other settings: evaluating it again")
        return False
    return True


def parent_evaluation(cfg, start: dict | None, sft: dict, sft_model: str | None, grpo: dict | None, traces: dict,
                      evals: str, parent_run_id: str, candidate_uri: str) -> dict | None:
    """The evaluation summary of the policy the candidate was trained from, on the candidate's games and settings
    (``cfg.evaluate``), for the paired test: recorded outcomes first, played only when none were recorded alike.

    - ``start`` (the champion or release a ``model.from_champion`` run retrained): the outcomes recorded on its
      registered version, else the release's recorded ones, else it plays.
    - ``sft_model`` (GRPO from a given model): the outcomes recorded on its registered version, else the release
      folder's, else (below) it plays.
    - otherwise, after GRPO: the SFT policy of this run plays. After ``--until sft`` with no start: None.
    """
    parent = None
    if start:
        parent = (recorded_evaluation(start["model_uri"], cfg.evaluate)
                  or release_parent_evaluation(start, cfg.registered_model_name, cfg.evaluate, parent_run_id))
        if parent is None:
            parent = evaluate_task(start["path"], cfg.evaluate, cfg.cost, evals, parent_run_id,
                                   start["experience_path"], start["model_uri"],
                                   name=f"evaluate-parent-{cfg.evaluate.split}", parent_of=candidate_uri,
                                   workspace_cfg=cfg.traces)
    if grpo and sft_model:
        parent = (recorded_evaluation(sft["model_uri"], cfg.evaluate)
                  or release_folder_evaluation(sft_model, cfg.evaluate, parent_run_id))
    if grpo and parent is None:
        parent = evaluate_task(sft["final_path"], cfg.evaluate, cfg.cost, evals, parent_run_id,
                               traces["experience_path"], sft.get("model_uri") or f"runs:/{sft['run_id']}",
                               name=f"evaluate-parent-{cfg.evaluate.split}", parent_of=candidate_uri,
                               workspace_cfg=cfg.traces)
    return parent
