"""Prefect tasks for the training stages: supervised harness fine-tuning and cost-aware GRPO.

Each runs its ``evoharness`` entry point under ``accelerate launch`` in a child process that logs into the
stage's nested MLflow run (``MLFLOW_RUN_ID``); a failed stage retried by Prefect resumes from its checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import mlflow
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from evoharness.config import PipelineConfig
from evoharness.env.alfworld import list_games
from evoharness.evaluation.plots import annealing_figure
from evoharness.faults import writer_lock
from evoharness.harness.context import layout_of
from evoharness.harness.workspace import ExperienceStore
from evoharness.registry.promotion import parse_model_uri
from evoharness.registry.release import experience_path as release_experience
from evoharness.registry.tracking import start_run
from evoharness.training.launch import accelerate_launch
from evoharness.training.model import build_default_model, load_policy, num_parameters
from evoharness.training.rollouts import read_history
from tasks.caching import RETRY, content_key, stage_policy


def _child_env(run_id: str) -> dict:
    return {
        "MLFLOW_RUN_ID": run_id,
        "MLFLOW_TRACKING_URI": mlflow.get_tracking_uri(),
        "MLFLOW_EXPERIMENT_ID": mlflow.get_experiment_by_name("evoharness").experiment_id,
    }


# the library code each stage runs (entry modules; their cache keys cover these and everything they import)
SFT_CODE = ("evoharness.training.sft", "evoharness.training.model")
GRPO_CODE = ("evoharness.training.grpo",)


def sft_dir(p: dict) -> Path:
    """``runs/sft/<key>``: keyed on the trace content hash, the model and the SFT settings."""
    return (
        Path(p["work_dir"])
        / "sft"
        / content_key(SFT_CODE, p["traces"]["content_hash"], p["cfg"].model, p["cfg"].sft, p["work_dir"])
    )


def grpo_dir(p: dict) -> Path:
    """``runs/grpo/<key>``: keyed on the SFT checkpoint (itself content-addressed), GRPO and cost settings."""
    sft_epoch = Path(p["sft"]["final_path"]).parent / ".cache-epoch"  # a retrained SFT folder has a new epoch
    epoch = sft_epoch.read_text() if sft_epoch.exists() else p["sft"].get("model_uri", "")  # --sft-model: its version
    return (
        Path(p["work_dir"])
        / "grpo"
        / content_key(
            GRPO_CODE, p["sft"]["final_path"], epoch, p["cfg"].grpo, p["cfg"].cost, p["cfg"].traces, p["work_dir"]
        )
    )


@task(
    name="sft",
    **RETRY,
    timeout_seconds=4 * 3600,
    cache_policy=stage_policy(sft_dir),
    persist_result=True,
)
def sft_task(cfg: PipelineConfig, traces: dict, work_dir: str, parent_run_id: str) -> dict:
    """Build the embedded default model (or take ``cfg.model.path``) and fine-tune it on the traces.

    ``cfg.model.path`` may be a registered version, ``models:/NAME/VERSION`` (pin the version: the cache key holds
    the string): it is downloaded once to ``<out>/parent`` and the run is tagged ``parent_model`` and
    ``parent_model_run_id``, so that a model trained further from another keeps its lineage.
    Cached on (trace hash, model and SFT settings, task source); a retried or re-run stage resumes from its
    checkpoints in the same folder."""
    out = sft_dir({"traces": traces, "cfg": cfg, "work_dir": work_dir})
    # one writer from the first file on (the base model, the parent's copy); the launch inside takes it again
    with writer_lock(out, what="sft stage"), start_run("sft", parent_run_id,
                                                        tags={"trace_hash": traces["content_hash"]}) as run:
        base = cfg.model.path
        if parse_model_uri(base) is not None:
            parent = take_model(base, work_dir, dst=out / "parent")
            mlflow.set_tags({"parent_model": parent["model_uri"], "parent_model_run_id": parent["run_id"]})
            base = parent["final_path"]
        elif not base:
            base = str(out / "base")
            if not (Path(base) / "config.json").exists():
                build_default_model(cfg.model, traces["train_file"], base)
        check_layout(base, cfg.traces)
        mlflow.log_params(
            {
                "base_model": cfg.model.path or "embedded-default",
                **{f"sft.{k}": v for k, v in dataclasses.asdict(cfg.sft).items()},
                **{f"model.{k}": v for k, v in dataclasses.asdict(cfg.model).items()},
            }
        )
        spec = {
            "model_path": base,
            "train_file": traces["train_file"],
            "valid_file": traces["valid_file"],
            "output_dir": str(out),
            "sft": dataclasses.asdict(cfg.sft),
            "layout": layout_of(cfg.traces),
        }
        result = accelerate_launch("evoharness.training.sft", spec, out, cfg.sft.num_processes,
                                   _child_env(run.info.run_id), config_file=cfg.sft.accelerate_config or None)
        model, _ = load_policy(result["final_path"])
        result["parameters"] = num_parameters(model)
        mlflow.log_metrics(
            {
                "parameters": result["parameters"],
                "global_step": result["global_step"],
                "world_size": result["world_size"],
                "final_train_loss": result["train_loss"],
                "tokens_seen": result.get("tokens_seen") or 0,
                "tokens_per_s": (result.get("tokens_seen") or 0) / max(result.get("train_runtime_s") or 1e-9, 1e-9),
                **{k: result[k] for k in ("steady_seconds_per_step", "steady_tokens_per_s") if result.get(k)},
            }
        )
        if result.get("time_budget"):  # sft.time_budget_s: the calibration and the steps it planned
            mlflow.log_dict(result["time_budget"], "time_budget.json")
            mlflow.log_metrics({f"time_budget.{k}": v for k, v in result["time_budget"].items()})
        mlflow.set_tags({f"layout.{k}": v for k, v in layout_of(cfg.traces).items()})
        mlflow.set_tag("sft.precision", result.get("precision", ""))
        mlflow.set_tag("sft.stopped_by_time_limit", str(bool(result.get("stopped_by_time_limit"))).lower())
        result["run_id"] = run.info.run_id
        result["base_model"] = cfg.model.path or "embedded-default"
    get_run_logger().info(f"sft: {result['global_step']} steps, loss {result['first_loss']} -> {result['last_loss']}")
    return result


def check_layout(model_path: str, traces) -> None:
    """Raise ValueError when the model at ``model_path`` records a context layout (``evoharness_layout`` in its
    ``config.json``) other than the one the traces are built in (``traces``, a ``TraceConfig``): fine-tuning it on
    them would teach it another prompt format. Models that record none (hub models) pass."""
    file = Path(model_path) / "config.json"
    recorded = json.loads(file.read_text()).get("evoharness_layout") if file.is_file() else None
    if not isinstance(recorded, dict):
        return
    want = layout_of(traces)
    differ = {k: (v, want[k]) for k, v in recorded.items() if k in want and want[k] != v}
    if differ:
        raise ValueError(f"{model_path} was trained on the layout {recorded}; the traces' differs in "
                         + ", ".join(f"traces.{k} (model {a!r}, profile {b!r})" for k, (a, b) in differ.items())
                         + ": set those traces fields in the profile to the model's")


@task(name="sft-from-model", **RETRY, timeout_seconds=3600, cache_policy=NO_CACHE)
def sft_from_model_task(model: str, work_dir: str) -> dict:
    """The SFT policy taken from ``model`` instead of trained (``flows.pipeline --sft-model``): ``take_model``."""
    return take_model(model, work_dir)


def take_model(model: str, work_dir: str, dst: Path | None = None) -> dict:
    """A registered version (``models:/NAME/VERSION`` or ``models:/NAME@ALIAS``, resolved to its version now and
    downloaded once to ``dst``, by default ``runs/sft/from-NAME-vVERSION``) or a local folder. Returns
    ``final_path``, ``run_id`` (the run that logged the version; "" for a folder) and ``model_uri`` (the pinned
    version), the keys the GRPO stage needs from SFT.

    Raises mlflow's ``MlflowException`` when the name, version or alias is not registered, ``FileNotFoundError``
    when a folder has no ``config.json``."""
    from mlflow import MlflowClient

    from evoharness.evaluation.evaluate import resolve_model_path

    parsed = parse_model_uri(model)
    if parsed is None:
        if not (Path(model) / "config.json").exists():
            raise FileNotFoundError(f"{model!r}: neither models:/NAME/VERSION, models:/NAME@ALIAS nor a "
                                    f"model folder with config.json")
        folder = str(Path(model).resolve())
        return {"final_path": folder, "run_id": "", "model_uri": folder,
                "experience_path": release_experience(folder)}  # a release plays with its own lessons
    name, version = parsed
    pinned = f"models:/{name}/{version}"
    dst = Path(dst) if dst is not None else Path(work_dir) / "sft" / f"from-{name}-v{version}"
    done = dst / "model" / "config.json"
    final = str(done.parent) if done.exists() else resolve_model_path(pinned, dst)
    get_run_logger().info(f"model taken from {model} ({pinned}) at {final}")
    return {"final_path": final, "run_id": MlflowClient().get_model_version(name, version).run_id,
            "model_uri": pinned}


@task(
    name="grpo",
    **RETRY,
    timeout_seconds=6 * 3600,
    cache_policy=stage_policy(grpo_dir),
    persist_result=True,
)
def grpo_task(cfg: PipelineConfig, sft: dict, traces: dict, work_dir: str, parent_run_id: str) -> dict:
    """Cost-aware GRPO from the SFT checkpoint on multi-turn ALFWorld episodes; logs the annealing curve.

    Cached on (SFT checkpoint, GRPO and cost settings, task source); resumes from its checkpoints. Either context
    layout (``evoharness.training.rollouts``)."""
    g = cfg.grpo
    out = grpo_dir({"sft": sft, "cfg": cfg, "work_dir": work_dir})
    games = list_games(g.split, limit=g.num_games, offset=g.game_offset)
    with writer_lock(out, what="grpo stage"), start_run("grpo", parent_run_id,
                                                         tags={"parent_model_run_id": sft["run_id"]}) as run:
        mlflow.log_params(
            {
                **{f"grpo.{k}": v for k, v in dataclasses.asdict(g).items()},
                "cost": json.dumps(dataclasses.asdict(cfg.cost)),
            }
        )
        spec = {
            "model_path": sft["final_path"],
            "games": games,
            "output_dir": str(out),
            "experience_path": str(out / "experience.db"),
            "grpo": dataclasses.asdict(g),
            "traces": dataclasses.asdict(cfg.traces),
            "cost": dataclasses.asdict(cfg.cost),
        }
        out.mkdir(parents=True, exist_ok=True)
        if not (out / "experience.db").exists() and Path(traces["experience_path"]).exists():
            ExperienceStore(traces["experience_path"]).copy_to(out / "experience.db")
        result = accelerate_launch("evoharness.training.grpo", spec, out, g.num_processes, _child_env(run.info.run_id),
                                   config_file=g.accelerate_config or None)
        history = read_history(out / "history.jsonl")  # a resumed step counted once
        mlflow.log_figure(annealing_figure(history), "annealing.png")
        result["run_id"] = run.info.run_id
        result["experience_path"] = str(out / "experience.db")
    get_run_logger().info(
        f"grpo: {result['global_step']} steps; meta-actions/episode "
        f"{result['first']['meta_actions']:.2f} -> {result['last']['meta_actions']:.2f}"
    )
    return result
