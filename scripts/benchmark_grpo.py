"""Benchmark (prints figures, not a timed test): GRPO rollouts per minute with 1 process and with 2 processes
(``grpo.num_processes``, the parallel rollout workers), one GRPO step on the same games from the same policy.

    python scripts/benchmark_grpo.py --model runs/sft/from-evoharness-policy-full-v1/model [--games 2]
        [--episodes 4] [--max-env-steps 20] [--profile full]

Each run is ``evoharness.training.grpo`` under ``accelerate launch``, as the pipeline starts it; rollouts per minute is
what the step logged (episodes over the step's rollout wall time, all processes together). Run it on an idle machine:
the processes compete for the same cores as anything else running.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evoharness.config import GRPOStageConfig, load_profile  # noqa: E402
from evoharness.env.alfworld import list_games  # noqa: E402
from evoharness.training.launch import accelerate_launch  # noqa: E402
from evoharness.training.rollouts import read_history  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a turn-context policy folder (e.g. an SFT final folder)")
    p.add_argument("--games", type=int, default=2, help="games per step (a multiple of 2)")
    p.add_argument("--episodes", type=int, default=4, help="episodes per game (the GRPO group)")
    p.add_argument("--max-env-steps", type=int, default=20)
    p.add_argument("--profile", default="full", help="the profile whose trace layout and cost the policy uses")
    a = p.parse_args(argv)
    prof = load_profile(a.profile)
    games = list_games("train", limit=a.games, offset=1000)
    print(f"{len(games)} train games x {a.episodes} episodes, {a.max_env_steps} environment steps at most, "
          f"policy {a.model}")
    for procs in (1, 2):
        cfg = GRPOStageConfig(num_generations=a.episodes, turns_per_episode=2, prompts_per_step=a.games, max_steps=1,
                              max_env_steps=a.max_env_steps, max_meta_actions=10, max_new_tokens=48,
                              num_processes=procs, save_steps=10)
        with tempfile.TemporaryDirectory() as tmp:
            spec = {"model_path": a.model, "games": games, "output_dir": tmp, "experience_path": f"{tmp}/exp.db",
                    "grpo": dataclasses.asdict(cfg), "cost": dataclasses.asdict(prof.cost),
                    "traces": dataclasses.asdict(prof.traces)}
            t0 = time.time()
            result = accelerate_launch("evoharness.training.grpo", spec, tmp, num_processes=procs)
            step = read_history(Path(tmp) / "history.jsonl")[0]
        print(json.dumps({"processes": result["world_size"], "episodes": step["episodes"],
                          "rollouts_per_min": round(step["rollouts_per_min"], 2),
                          "env_steps_per_episode": step["env_steps"], "stage_wall_s": round(time.time() - t0, 1)}))


if __name__ == "__main__":
    main()
