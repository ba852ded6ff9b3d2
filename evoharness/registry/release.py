"""Released policies: one self-contained folder per trained policy, committed to ``models/<name>/``.

A release outlives the machine and the MLflow store that trained it. Its folder holds:

- the model as ``save_pretrained`` writes it (``config.json`` with the context layout it was trained on,
  ``model.safetensors``, the tokenizer with its Qwen3 chat template, ``generation_config.json``), so
  ``AutoModelForCausalLM.from_pretrained(folder)`` loads it like any Hugging Face model folder;
- ``experience.db``: the Experience store the policy recalls lessons from;
- ``release.json``: the settings it plays with (``evaluate``, ``cost``), its lineage (command, git commit,
  profile, config digest, data md5, trace hash) and its training (steps, tokens, wall time, machine);
- ``evaluation/<split>.json``: the summary of its evaluation, and ``evaluation/<split>-episodes.jsonl`` one line per
  episode (the transcripts left out), so that the outcome on any subset of those games can be recomputed;
- ``README.md``: the model card (Hugging Face layout, ``evoharness.registry.model_card``).

Every command that takes a policy takes such a folder (``flows.evaluate --policy``, ``flows.pipeline --sft-model``,
``model.path``); evaluation then plays with the release's settings unless told otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
from pathlib import Path

from evoharness.config import CostConfig, EvalConfig

RELEASE_JSON = "release.json"
# save_pretrained's files a policy needs to load and generate; optimizer states and training arguments stay out
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", RELEASE_JSON)
MAX_RELEASE_BYTES = 25 * 2 ** 20
# The GRPO settings a release trained by GRPO records (release.json ``grpo``; its card lists them).
GRPO_CARD_KEYS = ("split", "num_games", "game_offset", "num_generations", "prompts_per_step", "turns_per_group",
                  "advantage", "gigpo_gamma", "gigpo_omega", "max_steps", "micro_batch_size", "temperature",
                  "learning_rate", "beta", "num_processes", "seed")


class ReleaseError(ValueError):
    """A release folder is incomplete or inconsistent; the message names the file and what to do."""


def is_release(path: str | Path) -> bool:
    """Whether ``path`` is a local folder holding ``release.json``."""
    return (Path(path) / RELEASE_JSON).is_file()


def read_release(path: str | Path) -> dict:
    """``release.json`` of the release folder ``path``, checked for the files a release needs.

    Raises ReleaseError naming the missing file (a partial copy, or a Git LFS pointer instead of the weights)."""
    path = Path(path)
    missing = [f for f in REQUIRED if not (path / f).is_file()]
    if missing:
        raise ReleaseError(f"{path}: not a complete release, missing {missing}; copy the whole folder, or export "
                           f"it again with `python -m evoharness.registry.release export`")
    if (path / "model.safetensors").stat().st_size < 1024:
        raise ReleaseError(f"{path / 'model.safetensors'}: {path.stat().st_size} bytes, not weights (a Git LFS "
                           f"pointer?); fetch the real file (`git lfs pull`) or export the release again")
    try:
        return json.loads((path / RELEASE_JSON).read_text())
    except json.JSONDecodeError as exc:
        raise ReleaseError(f"{path / RELEASE_JSON}: not JSON ({exc}); restore it from git") from exc


def play_settings(path: str | Path, overrides: dict | None = None) -> tuple[EvalConfig, CostConfig]:
    """The evaluation settings and cost model a release plays with (``release.json``), with ``overrides``
    (``EvalConfig`` field -> value; None values ignored) applied on top. Raises ReleaseError as ``read_release``."""
    rel = read_release(path)
    values = {**rel["evaluate"], **{k: v for k, v in (overrides or {}).items() if v is not None}}
    return EvalConfig(**values), CostConfig(**rel["cost"])


def experience_path(path: str | Path) -> str | None:
    """The release's Experience store, or None when the folder is not a release or has none."""
    db = Path(path) / "experience.db"
    return str(db) if is_release(path) and db.is_file() else None


def recorded_episodes(path: str | Path, split: str) -> list[dict]:
    """The per-episode results of the release's evaluation on ``split`` (``evaluation/<split>-episodes.jsonl``).

    Raises ReleaseError when the release holds no evaluation of that split."""
    file = Path(path) / "evaluation" / f"{split}-episodes.jsonl"
    if not file.is_file():
        raise ReleaseError(f"{file}: this release records no evaluation on {split!r}; evaluate it with "
                           f"`python -m flows.evaluate --policy {path} --split {split}`")
    return [json.loads(line) for line in file.read_text().splitlines() if line.strip()]


def recorded_summary(path: str | Path, split: str, games: list[str] | None = None) -> dict:
    """The summary of the release's recorded evaluation on ``split``; with ``games``, recomputed over just those
    games (``evoharness.evaluation.evaluate.summarize`` on the recorded episodes), for a paired comparison with a policy
    evaluated on them. Raises ReleaseError when a game was not played in the recorded evaluation."""
    from evoharness.evaluation.evaluate import summarize
    from evoharness.policy.agent import EpisodeResult

    rows = {r["game"]: r for r in recorded_episodes(path, split)}
    if games is None:
        return json.loads((Path(path) / "evaluation" / f"{split}.json").read_text())
    absent = [g for g in games if g not in rows]
    if absent:
        raise ReleaseError(f"{path}: its {split} evaluation did not play {len(absent)} of these games "
                           f"(first: {absent[0]}); evaluate the release on them instead")
    summary = summarize([EpisodeResult(**rows[g]) for g in games], split, len(rows))
    return summary | {"recorded_in": str(Path(path) / "evaluation" / f"{split}-episodes.jsonl")}


def release_bytes(path: str | Path) -> int:
    """Bytes of every file in the release folder."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def export_release(out: str | Path, model_dir: str | Path, experience: str | Path | None, summary: dict,
                   transcripts: str | Path, cfg, command: str, training: dict, name: str | None = None) -> Path:
    """Write a release folder ``out`` from a trained policy and its evaluation.

    Args:
        out: the release folder (created; an existing one is replaced).
        model_dir: the policy's ``save_pretrained`` folder (``runs/sft/<key>/final``).
        experience: the Experience store it played its evaluation with (``experience.db``), or None.
        summary: the pipeline summary (``flows.pipeline --summary-json``): its evaluation figures, ``won_by_game``,
            ``lineage`` (git commit, profile, config digest, data md5, trace hash) and ``sft``/``traces`` blocks.
        transcripts: that evaluation's ``transcripts.jsonl``; its episodes are kept without their turn-by-turn
            transcripts.
        cfg: the ``PipelineConfig`` that made it: its ``evaluate`` and ``cost`` sections become the release's
            play settings.
        command: the exact command that trained and evaluated it.
        training: steps, tokens, wall seconds, parameters, precision and machine (``model_card`` lists them).
        name: the release's name (default: the folder's name).

    Returns the folder. Raises ReleaseError when the transcripts' games differ from the summary's or the folder
    exceeds ``MAX_RELEASE_BYTES`` (25 MiB).
    """
    from evoharness.registry.model_card import render_card

    out, model_dir = Path(out), Path(model_dir)
    parent = parent_of(summary.get("lineage", {}).get("base_model"))  # read before ``out`` may replace it
    episodes = [json.loads(line) for line in Path(transcripts).read_text().splitlines() if line.strip()]
    for row in episodes:
        row["transcript"] = []  # the turn-by-turn text is for debugging, not for the figures
    if {r["game"]: bool(r["won"]) for r in episodes} != summary["won_by_game"]:
        raise ReleaseError(f"{transcripts}: its episodes' outcomes differ from the summary's won_by_game; pass the "
                           f"transcripts of the evaluation that summary reports")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "evaluation").mkdir(parents=True)
    for f in MODEL_FILES:
        if (model_dir / f).is_file():
            shutil.copy2(model_dir / f, tmp / f)
    if experience:
        shutil.copy2(experience, tmp / "experience.db")
    split = summary["split"]
    evaluation = {k: v for k, v in summary.items() if k not in ("lineage", "sft", "traces", "data", "promotion",
                                                                "stage_wall_s", "stage_cached", "grpo_steps",
                                                                "grpo_meta_actions_per_episode", "parent_evaluation",
                                                                "paired_test")}
    if parent and split in parent["won_by_game"]:  # paired on the parent's recorded games
        from evoharness.evaluation.stats import mcnemar_exact

        recorded = parent["won_by_game"][split]
        ours = {g: w for g, w in summary["won_by_game"].items() if g in recorded}
        parent["paired_test"] = {"split": split, **mcnemar_exact(ours, {g: recorded[g] for g in ours})}
    if parent:
        del parent["won_by_game"]  # read for the paired test; the parent's own folder keeps them
    (tmp / "evaluation" / f"{split}.json").write_text(json.dumps(evaluation, indent=1, sort_keys=True) + "\n")
    (tmp / "evaluation" / f"{split}-episodes.jsonl").write_text(
        "".join(json.dumps(r, sort_keys=True) + "\n" for r in episodes))
    lineage = summary.get("lineage", {})
    release = {
        "name": name or out.name,
        "command": command,
        "lineage": {k: lineage.get(k) for k in ("git_commit", "git_dirty", "profile", "config_digest", "dvc_md5",
                                                "data_path", "trace_hash", "base_model", "trained_until")},
        "traces": summary.get("traces", {}),
        "training": training,
        "parent": parent,
        "evaluate": dataclasses.asdict(cfg.evaluate),
        "cost": dataclasses.asdict(cfg.cost),
        "evaluations": {split: f"evaluation/{split}.json"},
    }
    if lineage.get("trained_until") == "grpo" and "episodes" in training:  # GRPO's figures: its settings too
        release["grpo"] = {k: v for k, v in dataclasses.asdict(cfg.grpo).items()
                           if k in GRPO_CARD_KEYS}
    (tmp / RELEASE_JSON).write_text(json.dumps(release, indent=1) + "\n")
    (tmp / "README.md").write_text(render_card(release, evaluation))
    size = release_bytes(tmp)
    if size > MAX_RELEASE_BYTES:
        shutil.rmtree(tmp)
        raise ReleaseError(f"{out}: {size / 2 ** 20:.1f} MiB, above the {MAX_RELEASE_BYTES / 2 ** 20:.0f} MiB a "
                           f"release may hold in git")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def parent_of(base_model: str | None) -> dict | None:
    """What a release trained further from the release folder ``base_model`` records of it: its name, the git commit
    that last wrote its ``release.json`` here (the parent's weights are in that commit), its command and profile,
    its training (steps, tokens, wall seconds, its own parent's totals included), recorded success rates and
    per-game outcomes (``won_by_game`` by split, for a paired test; not written to ``release.json``). None when
    ``base_model`` is not a release folder (scratch, a hub model, a registered version)."""
    if not base_model or not is_release(base_model):
        return None
    rel = read_release(base_model)
    folder = Path(base_model).resolve()
    commit = subprocess.run(["git", "log", "-1", "--format=%H", "--", RELEASE_JSON], capture_output=True, text=True,
                            cwd=folder).stdout.strip() or None
    tr, up = rel.get("training", {}), rel.get("parent") or {}
    success, won = {}, {}
    for split, file in rel.get("evaluations", {}).items():
        summary = json.loads((Path(base_model) / file).read_text())
        success[split], won[split] = summary["success_rate"], summary["won_by_game"]
    return {"name": rel.get("name"), "git_commit": commit, "command": rel.get("command"),
            "profile": rel.get("lineage", {}).get("profile"),
            "steps": tr.get("steps", 0) + up.get("steps", 0), "tokens": tr.get("tokens", 0) + up.get("tokens", 0),
            "train_seconds": tr.get("train_seconds", 0) + up.get("train_seconds", 0), "success_rate": success,
            "won_by_game": won}


# --- the local MLflow registry -------------------------------------------------------------------------------------

def _registry_tags(path: Path, rel: dict) -> dict:
    lin = rel["lineage"]
    return {"release": rel["name"], "release_path": str(path), "source_commit": lin.get("git_commit"),
            "git_commit": lin.get("git_commit"), "dvc_md5": lin.get("dvc_md5"), "data_path": lin.get("data_path"),
            "trace_hash": lin.get("trace_hash"), "config_digest": lin.get("config_digest"),
            "profile": lin.get("profile"), "trained_until": lin.get("trained_until"),
            "training_run": "not in this store: see the release's model card",
            "experience_artifact": "release/experience.db"}


def find_registered(path: str | Path, registered_name: str) -> str | None:
    """The version of ``registered_name`` already registered from this release (same name and source commit)."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    rel = read_release(path)
    try:
        versions = MlflowClient().search_model_versions(f"name='{registered_name}'")
    except MlflowException:
        return None
    for mv in sorted(versions, key=lambda v: int(v.version)):
        if mv.tags.get("release") == rel["name"] and mv.tags.get("source_commit") == rel["lineage"].get("git_commit"):
            return str(mv.version)
    return None


def register_release(path: str | Path, registered_name: str, parent_run_id: str | None = None) -> dict:
    """Register the release folder ``path`` as a version of ``registered_name`` in the active MLflow store, once.

    The version is logged with ``mlflow.transformers.log_model`` (as the pipeline registers its policies), tagged
    with the card's lineage (``release``, ``source_commit``, ``dvc_md5``, ``trace_hash``, ``config_digest``,
    ``profile``) and aliased ``release``; the folder's ``release.json``, Experience store, evaluation and card are
    logged beside it (artifact ``release/``), and its recorded evaluation becomes an evaluation run linked to the
    version (``record_evaluation``), so promotion and ``flows.pipeline`` can compare against it without replaying.
    A release registered before (same name and source commit) is not registered again. ``parent_run_id``: the
    run (a pipeline's) to nest the registration and evaluation runs under.

    Returns ``{"model_uri", "version", "registered": bool}``. Raises ReleaseError for an incomplete folder."""
    import mlflow

    from evoharness.registry.tracking import log_and_register, start_run

    path = Path(path).resolve()
    rel = read_release(path)
    version = find_registered(path, registered_name)
    if version is not None:
        return {"model_uri": f"models:/{registered_name}/{version}", "version": version, "registered": False}
    tags = _registry_tags(path, rel)
    with start_run(f"register-release-{rel['name']}", parent_run_id, tags=tags):
        mlflow.log_dict(rel, "release/release.json")
        for f in ("README.md", "experience.db"):
            if (path / f).is_file():
                mlflow.log_artifact(str(path / f), "release")
        mlflow.log_artifacts(str(path / "evaluation"), "release/evaluation")
        info = log_and_register(str(path), registered_name, "release", tags)
    for split in rel.get("evaluations", {}):  # the games it was evaluated on: its own evaluate.limit
        record_evaluation(path, registered_name, info["version"], split, rel["evaluate"]["limit"], parent_run_id)
    return info | {"registered": True}


def record_evaluation(path: str | Path, registered_name: str | None, version: str | None, split: str,
                      limit: int = 0, parent_run_id: str | None = None) -> dict:
    """Record the release's evaluation on ``limit`` evenly spaced games of ``split`` (0 = all it played) as an
    MLflow run, with the release's evaluation settings as parameters; with ``registered_name`` and ``version``, linked
    to that registered version (``evoharness.registry.promotion.link_evaluation``), so
    ``tasks.evaluation.recorded_evaluation``
    reuses it for a candidate evaluated on the same games with the same settings. Returns the summary with
    ``mlflow_run_id`` and ``games``. The outcomes are the recorded episodes of those games (``recorded_summary``),
    not a replay."""
    import mlflow

    from evoharness.env.alfworld import list_games
    from evoharness.evaluation.evaluate import spread
    from evoharness.registry.promotion import link_evaluation
    from evoharness.registry.tracking import flat, start_run

    games = spread(list_games(split), limit)
    summary = recorded_summary(path, split, games)
    settings = read_release(path)["evaluate"] | {"split": split, "limit": limit}
    uri = f"models:/{registered_name}/{version}" if registered_name and version else str(Path(path).resolve())
    with start_run(f"evaluate-{split}", parent_run_id, tags={"policy": str(path), "split": split,
                                                             "recorded_in_release": "true", "model_uri": uri}) as run:
        mlflow.log_params({f"evaluate.{k}": v for k, v in settings.items()})
        mlflow.log_metrics(flat("", {k: v for k, v in summary.items() if k not in ("errors", "won_by_game")}))
        mlflow.log_dict(summary | {"games": games}, "summary.json")
    if registered_name and version:
        link_evaluation(uri, split, games, summary["success_rate"], run.info.run_id)
    return summary | {"mlflow_run_id": run.info.run_id, "games": games}


def replay(path: str | Path, split: str, index: int, work_dir: str | Path):
    """Play game ``index`` of the release's recorded ``split`` evaluation alone, greedily, with the release's settings
    and Experience store, at its position (its seed and workspace name); returns the ``EpisodeResult``."""
    from evoharness.config import TraceConfig
    from evoharness.evaluation.evaluate import play_games

    cfg, cost = play_settings(path, {"workers": 1})
    game = recorded_episodes(path, split)[index]["game"]
    results, _ = play_games(str(path), [game], cfg, cost, Path(work_dir), experience_path(path), progress=None,
                            workspace_cfg=TraceConfig(), indices=[index])
    return results[0]


def find_smoke_game(path: str | Path, split: str, work_dir: str | Path, tries: int = 8) -> dict:
    """A won game of the recorded evaluation that the release, played alone, wins again in the recorded steps with
    the recorded meta-actions: its "known game". In the recorded run a worker's later games recall lessons its
    earlier games noted, so not every game replays alone; the recorded games won are tried in order, ``tries`` at
    most. Returns ``{"split", "index", "game", "env_steps", "meta_actions"}``. Raises ReleaseError when none does."""
    episodes = recorded_episodes(path, split)
    won = [i for i, e in enumerate(episodes) if e["won"]][:tries]
    for i in won:
        res = replay(path, split, i, Path(work_dir) / f"game-{i}")
        rec = episodes[i]
        if res.won and res.env_steps == rec["env_steps"] and res.meta_actions == rec["meta_actions"]:
            return {"split": split, "index": i, "game": rec["game"], "env_steps": rec["env_steps"],
                    "meta_actions": rec["meta_actions"]}
    raise ReleaseError(f"{path}: none of the first {len(won)} games won in its {split} evaluation replays alone")


def machine_description() -> str:
    """This machine in words: CPU model, cores, whether it has AVX512-BF16 (bf16 autocast) or trains in fp32."""
    import os
    import platform

    model, flags = platform.processor() or platform.machine(), ""
    try:
        info = Path("/proc/cpuinfo").read_text()
        model = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name"))
        flags = next(line for line in info.splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        pass
    isa = "AVX512-BF16" if "avx512_bf16" in flags else ("AVX2, no AVX512-BF16" if "avx2" in flags else "")
    return f"{os.cpu_count()} CPU cores, {model}" + (f" ({isa})" if isa else "")


def training_from(summary: dict, sft_result: dict, model_dir: str | Path, machine: str) -> dict:
    """The ``training`` block of ``release.json`` from the pipeline summary's ``sft`` block and the SFT stage's
    ``result.json`` (precision, steady rate, time budget)."""
    sft = summary["sft"]
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return {"parameters": sft["parameters"], "steps": sft["global_step"], "tokens": sft["tokens_seen"],
            "train_seconds": sft["train_runtime_s"], "first_loss": sft.get("first_loss"),
            "last_loss": sft.get("last_loss"), "world_size": sft.get("world_size"),
            "precision": sft_result.get("precision", ""), "time_budget": sft_result.get("time_budget"),
            "stopped_by_time_limit": sft_result.get("stopped_by_time_limit"),
            "steady_seconds_per_step": sft_result.get("steady_seconds_per_step"),
            "layout": config.get("evoharness_layout", {}), "machine": machine}


def training_from_grpo(summary: dict, grpo_dir: str | Path, cfg, machine: str) -> dict:
    """The ``training`` block of ``release.json`` for a policy trained further by cost-aware GRPO, from the GRPO
    stage folder ``runs/grpo/<key>`` (``result.json``, ``history.jsonl``, ``final/``) and the pipeline summary.

    ``steps`` counts GRPO optimizer updates, ``tokens`` the tokens the policy generated in its training rollouts
    (sum over steps of episodes x generated tokens per episode), ``train_seconds`` the GRPO stage's wall time;
    ``sft_steps``, ``sft_tokens``, ``sft_seconds`` when the same run trained SFT first (no ``--sft-model``).
    Raises FileNotFoundError when the folder lacks ``result.json`` or ``final/``."""
    from evoharness.training.model import load_policy, num_parameters

    grpo_dir = Path(grpo_dir)
    result = json.loads((grpo_dir / "result.json").read_text())
    history = [json.loads(line) for line in (grpo_dir / "history.jsonl").read_text().splitlines() if line.strip()]
    config = json.loads((grpo_dir / "final" / "config.json").read_text())
    sft = summary.get("sft") or {}
    trained_here = {"sft_steps": sft["global_step"], "sft_tokens": sft.get("tokens_seen") or 0,
                    "sft_seconds": sft.get("train_runtime_s") or 0} if sft.get("global_step") else {}
    parameters = num_parameters(load_policy(str(grpo_dir / "final"))[0])
    return trained_here | {"parameters": parameters, "steps": result["global_step"],
            "tokens": round(sum(h["episodes"] * h["generated_tokens"] for h in history)),
            "episodes": sum(h["episodes"] for h in history),
            "train_seconds": round(summary["stage_wall_s"]["grpo"], 1), "world_size": result.get("world_size"),
            "precision": "fp32" if not cfg.grpo.bf16 else "bf16 on a GPU, fp32 on CPU",
            "layout": config.get("evoharness_layout", {}), "machine": machine}


def main(argv: list[str] | None = None) -> int:
    """``export`` a release folder from a pipeline run, ``register`` one in the local MLflow registry, or ``show``
    its card's figures. Exits 2 with the reason on bad input."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m evoharness.registry.release",
                                description="Released policies (models/).")
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="write models/<name> from a finished `flows.pipeline` run "
                                      "(SFT, or GRPO with --sft-model)")
    e.add_argument("--summary", required=True, help="the run's --summary-json")
    e.add_argument("--sft-dir", default=None,
                   help="the SFT stage folder runs/sft/<key> (final/ and result.json; default: the summary's paths)")
    e.add_argument("--grpo-dir", default=None,
                   help="for a policy trained by GRPO (the summary's trained_until): the GRPO stage folder "
                        "runs/grpo/<key> (final/, result.json, history.jsonl; default: the summary's paths)")
    e.add_argument("--parent", default=None,
                   help="the release folder GRPO started from, e.g. models/evoharness-full-sft (default: the "
                        "summary's parent_model_uri when it is a release folder)")
    e.add_argument("--experience", default=None,
                   help="the Experience store it was evaluated with (default: the summary's paths)")
    e.add_argument("--transcripts", default=None,
                   help="the evaluation's transcripts.jsonl (default: the summary's paths)")
    e.add_argument("--profile", required=True, help="the profile that made it (its evaluate and cost sections)")
    e.add_argument("--command", required=True, help="the exact command that made it, for the card")
    e.add_argument("--machine", default=None, help="the training machine in words (default: this one)")
    e.add_argument("--out", required=True, help="the release folder, e.g. models/evoharness-full-sft")
    k = sub.add_parser("smoke", help="find and record the release's known game (release.json smoke_game)")
    k.add_argument("release")
    k.add_argument("--work-dir", default="runs/release-smoke")
    r = sub.add_parser("register", help="register a release folder in the local MLflow registry")
    r.add_argument("release")
    r.add_argument("--name", default="evoharness-policy", help="registered model name (default: evoharness-policy)")
    r.add_argument("--repo", default=".", help="the checkout holding mlflow/ (default: .)")
    a = p.parse_args(argv)
    try:
        if a.cmd == "export":
            from evoharness.config import load_profile

            summary = json.loads(Path(a.summary).read_text())
            paths, cfg = summary.get("paths") or {}, load_profile(a.profile)
            machine = a.machine or machine_description()
            if summary.get("lineage", {}).get("trained_until") == "grpo":
                grpo_dir = Path(a.grpo_dir or Path(paths["final_path"]).parent)
                training = training_from_grpo(summary, grpo_dir, cfg, machine)
                model_dir = grpo_dir / "final"
                parent = a.parent or summary["lineage"].get("parent_model_uri")
                summary["lineage"] = {**summary["lineage"], "base_model": parent}
            else:
                sft_dir = Path(a.sft_dir or paths["sft_dir"])
                result = json.loads((sft_dir / "result.json").read_text())
                training = training_from(summary, result, sft_dir / "final", machine)
                model_dir = sft_dir / "final"
            out = export_release(a.out, model_dir, a.experience or paths["experience_path"], summary,
                                 a.transcripts or paths["transcripts"], cfg, a.command, training)
            print(f"{out}: {release_bytes(out) / 2 ** 20:.1f} MiB; card {out / 'README.md'}")
        elif a.cmd == "smoke":
            rel = read_release(a.release)
            split = next(iter(rel["evaluations"]))
            rel["smoke_game"] = find_smoke_game(a.release, split, a.work_dir)
            (Path(a.release) / RELEASE_JSON).write_text(json.dumps(rel, indent=1) + "\n")
            print(f"{a.release}: known game {rel['smoke_game']['game']} (index {rel['smoke_game']['index']}, "
                  f"won in {rel['smoke_game']['env_steps']} steps)")
        else:
            from evoharness.registry.tracking import configure

            configure(a.repo)
            info = register_release(a.release, a.name)
            print(f"{a.release}: {'registered as' if info['registered'] else 'already registered as'} "
                  f"{info['model_uri']} (alias release); lineage: make lineage ARGS=\"{info['model_uri']}\"")
    except (ReleaseError, FileNotFoundError, KeyError) as exc:
        print(f"evoharness.registry.release: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
