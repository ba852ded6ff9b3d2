"""Evaluation alone: play a split with any policy.

    python -m flows.evaluate --policy RELEASE|MODEL_PATH|models:/NAME@ALIAS|expert|random --split NAME [--limit N]
                             [--summary-json FILE] [--profile NAME] [--decoding remap|score] [--work-dir DIR]
                             [--workers W] [--meta-only-turns] [--ground-track | --no-ground-track]

``--work-dir DIR`` (default: a new ``runs/<time>-eval-<split>``): the folder above ``evaluate-<split>`` of an
earlier, interrupted evaluation of the same policy with the same settings (or that ``evaluate-<split>`` folder
itself) resumes there: its finished episodes are kept and only the missing games, and those whose environment
failed, are played (``evoharness.evaluation.evaluate.evaluate``).

A release folder (``models/<name>``, ``evoharness.registry.release``) plays with its own settings (``release.json``:
step and meta-action budgets, decoding, workers, cost model) and its own Experience store unless ``--profile`` or a flag
says otherwise, so ``--policy models/<name>`` alone gives back the figures of its model card.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import yaml
from prefect import flow

from evoharness.config import load_profile, parse_overrides
from evoharness.evaluation.report import write_summary
from evoharness.registry.release import (
    ReleaseError,
    experience_path,
    is_release,
    play_settings,
    recorded_summary,
)
from evoharness.registry.tracking import configure, git_info, start_run
from tasks.evaluation import evaluate_task

REPO = str(Path(__file__).resolve().parent.parent)


@flow(name="evoharness-evaluate", log_prints=True)
def evaluate_flow(policy: str, split: str = "valid_seen", limit: int = 0, profile: str | None = None,
                  summary_json: str | None = None, repo: str = REPO, decoding: str | None = None,
                  work_dir: str | None = None, workers: int | None = None, act_each_turn: bool | None = None,
                  ground_track: bool | None = None, overrides: list[str] | None = None) -> dict:
    """Evaluate ``policy`` on ``split`` (``limit`` games evenly spaced, 0 = all); logs one MLflow run.
    ``decoding`` overrides the profile's ``evaluate.decoding`` (``remap`` or ``score``). ``work_dir``: resume an
    evaluation there (see the module docstring); raises ValueError when it holds another policy's or settings'.
    ``workers`` overrides ``evaluate.workers`` (processes, ``evoharness.evaluation.workers``); ``act_each_turn``
    overrides ``evaluate.act_each_turn`` (``EvalConfig``: a parallel-calls turn without an act gets one scored);
    ``ground_track`` overrides ``evaluate.ground_track`` (a track's names scored over the latest observation's).
    ``profile``: the settings to play with (default: a release's own, ``release.json``; else ``default``).
    ``overrides``: ``evaluate.FIELD=VALUE`` / ``cost.FIELD=VALUE`` strings on top of those settings
    (``evoharness.config.parse_overrides``; e.g. ``evaluate.max_env_steps=70``)."""
    over = parse_overrides(overrides or [])
    cfg = load_profile(profile or "default", over)
    flags = {"split": split, "limit": limit, "decoding": decoding, "workers": workers,
             "act_each_turn": act_each_turn, "ground_track": ground_track}
    experience = None
    if is_release(policy):
        experience = experience_path(policy)
        if profile is None:  # the release's own settings, then the overrides
            cfg.evaluate, cfg.cost = play_settings(policy, {**over.get("evaluate", {}), **flags})
            cfg.cost = dataclasses.replace(cfg.cost, **over.get("cost", {}))
    ev_cfg = dataclasses.replace(cfg.evaluate, **{k: v for k, v in flags.items() if v is not None})
    configure(repo)
    work = work_folder(work_dir, split, repo)
    with start_run(f"evaluate-{split}", tags={**git_info(repo), "policy": policy}) as run:  # records its process
        summary = evaluate_task(policy, ev_cfg, cfg.cost, str(work), run.info.run_id, experience_path=experience,
                                model_uri=policy, workspace_cfg=cfg.traces)
    summary["model_uri"] = policy
    print_evaluation(policy, split, summary)
    if summary_json:
        write_summary(summary, summary_json)
    return summary


def print_evaluation(policy: str, split: str, summary: dict) -> None:
    """Print the games won by task type, where the transcripts are, and for a release folder its recorded outcomes
    on the same games (the card's evaluation), game by game."""
    won = sum(summary["won_by_game"].values())
    print(f"{policy} on {split}: {won} of {summary['episodes']} won ({summary['success_rate']:.1%}); "
          f"MLflow run {summary['mlflow_run_id']}")
    for t, rate in sorted(summary["success_by_task_type"].items()):
        n = summary["episodes_by_task_type"][t]
        print(f"  {t:<9} {round(rate * n):>3} of {n:<3} ({rate:.1%})")
    print(f"transcripts: {summary.get('transcripts')}")
    if is_release(policy):
        try:
            recorded = recorded_summary(policy, split, list(summary["won_by_game"]))
        except ReleaseError as exc:  # games or a split its own evaluation did not play
            print(f"no recorded outcomes to compare with: {exc}")
            return
        same = sum(recorded["won_by_game"][g] == w for g, w in summary["won_by_game"].items())
        print(f"recorded in the release on these games: {sum(recorded['won_by_game'].values())} of "
              f"{recorded['episodes']} won; the same outcome on {same} of {summary['episodes']} games")


def work_folder(work_dir: str | None, split: str, repo: str = REPO) -> Path:
    """The folder the evaluation writes ``evaluate-<split>`` into: ``work_dir``, or its parent when ``work_dir`` is
    itself an ``evaluate-<split>`` folder (the one holding ``transcripts.jsonl``, which a person resuming is apt to
    name), so it resumes there instead of nesting a new, empty one (unless an earlier run nested one there already);
    a new ``runs/<time>-eval-<split>`` when None."""
    if not work_dir:
        return Path(repo) / "runs" / time.strftime(f"%Y%m%d-%H%M%S-eval-{split}")
    path = Path(work_dir)
    nested = path / f"evaluate-{split}"  # written by an earlier run given this folder: resume that one
    return path.parent if path.name == f"evaluate-{split}" and not nested.exists() else path


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m flows.evaluate", description="Evaluate a policy on an ALFWorld split.")
    p.add_argument("--policy", required=True,
                   help="release folder (models/NAME), model folder, models:/NAME@ALIAS, expert or random")
    p.add_argument("--split", default="valid_seen")
    p.add_argument("--limit", type=int, default=0, help="N games evenly spaced over the split (0 = all)")
    p.add_argument("--profile", default=None,
                   help="settings to play with (default: a release's own, else the default profile's)")
    p.add_argument("--summary-json", default=None)
    p.add_argument("--decoding", default=None, choices=["remap", "score"],
                   help="how an act call becomes an admissible command (default: the profile's)")
    p.add_argument("--work-dir", default=None,
                   help="resume the evaluation in this folder or its evaluate-<split> subfolder (default: a new one)")
    p.add_argument("--workers", type=int, default=None,
                   help="processes playing the games, each with its own policy copy (default: the profile's)")
    p.add_argument("--meta-only-turns", action="store_true",
                   help="parallel-calls models: let a turn that generated no act run its meta-actions only "
                        "(evaluate.act_each_turn false, as evaluations before 2026-12-01 played)")
    p.add_argument("--ground-track", action=argparse.BooleanOptionalAction, default=None,
                   help="score a track call's entity (and a location's value) over the names in the latest observation "
                        "(evaluate.ground_track; default: the profile's, on in full and grpo-budget)")
    p.add_argument("overrides", nargs="*", metavar="SECTION.FIELD=VALUE",
                   help="evaluate.* or cost.* settings on top of the profile's or release's, "
                        "e.g. evaluate.max_env_steps=70")
    a = p.parse_args(argv)
    try:  # a profile typo or a bad value is a usage error: said now, before any Prefect server starts
        over = parse_overrides(a.overrides)
        if set(over) - {"evaluate", "cost"}:
            raise ValueError(f"{sorted(set(over) - {'evaluate', 'cost'})}: evaluation takes evaluate.* and cost.* only")
        load_profile(a.profile or "default", over)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        p.error(str(exc))  # the message and exit status 2, no traceback
    return evaluate_flow(a.policy, a.split, a.limit, a.profile, a.summary_json, decoding=a.decoding,
                         work_dir=a.work_dir, workers=a.workers, act_each_turn=False if a.meta_only_turns else None,
                         ground_track=a.ground_track, overrides=a.overrides)


if __name__ == "__main__":
    main()
