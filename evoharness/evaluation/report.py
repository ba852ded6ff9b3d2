"""The pipeline's summary: one JSON document and a table printed at the end of ``make run``."""

from __future__ import annotations

import json
from pathlib import Path

from evoharness.harness.workspace import META_ACTIONS

EVAL_KEYS = ("split", "episodes", "games_in_split", "success_rate", "success_by_task_type", "episodes_by_task_type",
             "mean_steps", "meta_actions_per_episode", "meta_actions_by_task_type", "generated_tokens_per_episode",
             "cost_per_episode", "cost_per_episode_by_type", "malformed_per_episode", "rejected_turns_per_episode",
             "remapped_per_episode", "errors", "won_by_game")


def pipeline_summary(ev: dict, parent_ev: dict, model: dict, grpo: dict, sft: dict, traces: dict, data: dict,
                     walls: dict, cached: dict, promotion: dict, parent_run_id: str, lineage: dict,
                     ingest: dict | None = None) -> dict:
    """Merge the stages' results into the summary (evaluation keys at top level, as ``flows.evaluate`` writes).
    ``grpo`` and ``parent_ev`` are None when the pipeline stopped after SFT. ``ingest``: ``{"on_error",
    "quarantined_records"}`` of the ingest stage (all data folders together)."""
    return {
        **{k: ev[k] for k in EVAL_KEYS},
        "mlflow_run_id": parent_run_id,
        "evaluation_run_id": ev["mlflow_run_id"],
        "model_uri": model["model_uri"],
        "stage_wall_s": walls,
        "stage_cached": cached,
        "grpo_meta_actions_per_episode": {
            "first_step": {m: grpo["first"][f"meta_actions_{m}"] for m in META_ACTIONS},
            "last_step": {m: grpo["last"][f"meta_actions_{m}"] for m in META_ACTIONS}} if grpo else None,
        "grpo_steps": grpo["global_step"] if grpo else 0,
        # .get: a parent's recorded evaluation may predate a key (rejected turns were added after issue 6's first run)
        "parent_evaluation": ({k: parent_ev.get(k) for k in EVAL_KEYS} | {"mlflow_run_id": parent_ev["mlflow_run_id"]}
                              if parent_ev else None),
        "promotion": promotion,
        # the time-budget fields (sft.time_budget_s): the plan, and whether the guard rather than the plan ended it
        "sft": {k: sft.get(k) for k in ("global_step", "first_loss", "last_loss", "parameters", "world_size",
                                        "train_runtime_s", "tokens_seen", "max_steps", "steady_seconds_per_step",
                                        "steady_tokens_per_s", "time_budget", "stopped_by_time_limit")},
        "traces": {k: traces.get(k) for k in ("episodes", "kept", "dagger_episodes", "train_rows", "valid_rows",
                                             "content_hash")},
        "data": data,
        "ingest": ingest or {"on_error": "stop", "quarantined_records": 0},
        "lineage": lineage,
    }


def print_summary(s: dict) -> None:
    """Print the summary as plain-text tables."""
    print("\n=== EvoHarness pipeline summary ===")
    print(f"{'stage':<14}{'wall s':>9}  cached")
    for stage, sec in s["stage_wall_s"].items():
        print(f"{stage:<14}{sec:>9.1f}  {'yes' if s['stage_cached'].get(stage) else ''}")
    print(f"{'total':<14}{sum(s['stage_wall_s'].values()):>9.1f}")
    p = s["parent_evaluation"]
    print(f"\nevaluation on {s['split']}: {s['episodes']} of {s['games_in_split']} games (evenly spaced)")
    if p is None:  # stopped after SFT
        print(f"{'task type':<10}{'episodes':>9}{'SFT':>8}")
        for k, v in s["success_by_task_type"].items():
            print(f"{k:<10}{s['episodes_by_task_type'][k]:>9}{v:>8.3f}")
        print(f"{'All':<10}{s['episodes']:>9}{s['success_rate']:>8.3f}")
        print(f"mean steps {s['mean_steps']:.1f}; generated tokens/episode {s['generated_tokens_per_episode']:.0f}")
        print("meta-actions per episode: " + ", ".join(f"{m} {s['meta_actions_per_episode'][m]:.2f}"
                                                        for m in META_ACTIONS))
    else:
        a, b = ("candidate", "parent") if s.get("parent_model_uri", "").startswith("models:/") else ("GRPO", "SFT")
        print(f"{'task type':<10}{'episodes':>9}{a:>10}{b:>8}")
        for k, v in s["success_by_task_type"].items():
            print(f"{k:<10}{s['episodes_by_task_type'][k]:>9}{v:>10.3f}{p['success_by_task_type'][k]:>8.3f}")
        print(f"{'All':<10}{s['episodes']:>9}{s['success_rate']:>10.3f}{p['success_rate']:>8.3f}")
        print(f"mean steps {s['mean_steps']:.1f} ({b} {p['mean_steps']:.1f}); generated tokens/episode "
              f"{s['generated_tokens_per_episode']:.0f} ({b} {p['generated_tokens_per_episode']:.0f})")
        t = s.get("paired_test")
        if t:
            print(f"paired on the same {t['games']} games: {a} won {t['won_a']}, {b} ({s['parent_model_uri']}) won "
                  f"{t['won_b']}; only {a} {t['only_a']}, only {b} {t['only_b']}; exact McNemar p = {t['p']:.3f}")
        g = s["grpo_meta_actions_per_episode"]
        print(f"\n{'meta-action':<12}{'GRPO first':>11}{'GRPO last':>11}{'eval ' + a:>16}{'eval ' + b:>12}"
              "   (per episode)")
        for m in META_ACTIONS:
            first, last = (f"{g['first_step'][m]:>11.2f}", f"{g['last_step'][m]:>11.2f}") if g else ("-", "-")
            print(f"{m:<12}{first:>11}{last:>11}{s['meta_actions_per_episode'][m]:>16.2f}"
                  f"{p['meta_actions_per_episode'][m]:>12.2f}")
    t = s["sft"]
    if t.get("global_step"):
        plan = t.get("time_budget") or {}
        print(f"\nSFT: {t['global_step']} steps in {t['train_runtime_s'] or 0:.0f} s, {t['tokens_seen'] or 0:,} tokens"
              + (f"; time budget {plan['time_budget_s']:.0f} s planned {plan['max_steps']} steps" if plan else "")
              + ("; stopped by the time budget" if t.get("stopped_by_time_limit") else ""))
    pr = s["promotion"]
    kept = f"kept at v{pr['champion_version']}" if pr["champion_version"] else "none"
    print(f"\nregistered {s['model_uri']} (alias candidate); champion: "
          f"{'moved to it' if pr['promoted'] else kept} ({pr.get('reason', '')})")
    print(f"data: {s['data']['status']}, DVC md5 {s['data']['md5']}; trace hash {s['traces']['content_hash'][:16]}")
    ing = s.get("ingest") or {}
    if ing.get("on_error") == "quarantine" or ing.get("quarantined_records"):
        print(f"ingest: {ing.get('quarantined_records', 0)} bad raw-log records quarantined (ingest.on_error: "
              f"{ing.get('on_error')}), set aside in runs/quarantine/<md5>.jsonl")
    print(f"MLflow run id: {s['mlflow_run_id']}")


def write_summary(summary: dict, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(summary, indent=1, sort_keys=True))
