"""The pipeline's summary: one JSON document and a table printed at the end of ``make run``."""

from __future__ import annotations

import json
from pathlib import Path

from evoharness.harness import META_ACTIONS


def pipeline_summary(ev: dict, model: dict, grpo: dict, sft: dict, traces: dict, data: dict, walls: dict,
                     parent_run_id: str, lineage: dict) -> dict:
    """Merge the stages' results into the summary (evaluation keys at top level, as ``flows.evaluate`` writes)."""
    per_type = {m: (grpo["first"][f"meta_actions_{m}"], grpo["last"][f"meta_actions_{m}"]) for m in META_ACTIONS}
    return {
        **{k: ev[k] for k in ("split", "episodes", "games_in_split", "success_rate", "success_by_task_type",
                              "episodes_by_task_type", "mean_steps", "meta_actions_per_episode",
                              "generated_tokens_per_episode", "malformed_per_episode", "errors")},
        "mlflow_run_id": parent_run_id,
        "evaluation_run_id": ev["mlflow_run_id"],
        "model_uri": model["model_uri"],
        "stage_wall_s": walls,
        "grpo_meta_actions_per_episode": {"first_step": {m: a for m, (a, _) in per_type.items()},
                                          "last_step": {m: b for m, (_, b) in per_type.items()}},
        "grpo_steps": grpo["global_step"],
        "sft": {k: sft.get(k) for k in ("global_step", "first_loss", "last_loss", "parameters", "world_size")},
        "traces": {k: traces.get(k) for k in ("episodes", "kept", "train_rows", "valid_rows", "content_hash")},
        "data": data,
        "lineage": lineage,
    }


def print_summary(s: dict) -> None:
    """Print the summary as plain-text tables."""
    print("\n=== EvoHarness pipeline summary ===")
    print(f"{'stage':<14}{'wall s':>9}")
    for stage, sec in s["stage_wall_s"].items():
        print(f"{stage:<14}{sec:>9.1f}")
    print(f"{'total':<14}{sum(s['stage_wall_s'].values()):>9.1f}")
    print(f"\nevaluation on {s['split']}: {s['episodes']} of {s['games_in_split']} games, "
          f"success rate {s['success_rate']:.3f}, mean steps {s['mean_steps']:.1f}, "
          f"generated tokens/episode {s['generated_tokens_per_episode']:.0f}")
    print(f"{'task type':<10}{'episodes':>9}{'success':>9}")
    for k, v in s["success_by_task_type"].items():
        print(f"{k:<10}{s['episodes_by_task_type'][k]:>9}{v:>9.3f}")
    print(f"\n{'meta-action':<12}{'GRPO first':>11}{'GRPO last':>11}{'eval':>9}   (per episode)")
    g = s["grpo_meta_actions_per_episode"]
    for m in META_ACTIONS:
        print(f"{m:<12}{g['first_step'][m]:>11.2f}{g['last_step'][m]:>11.2f}{s['meta_actions_per_episode'][m]:>9.2f}")
    print(f"\ndata: {s['data']['status']}, DVC md5 {s['data']['md5']}; trace hash {s['traces']['content_hash'][:16]}")
    print(f"MLflow run id: {s['mlflow_run_id']}   model: {s['model_uri']}")


def write_summary(summary: dict, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(summary, indent=1, sort_keys=True))
