"""Cost-aware GRPO with TRL's ``GRPOTrainer`` on multi-turn ALFWorld episodes played through the harness.

Why ``rollout_func`` rather than ``environment_factory``: the episode is played by the same policy loop as
evaluation (``evoharness.agent.run_episode`` with ``LMPolicy``), which turns ``act`` into an admissible command, runs
meta-actions against the ``Workspace`` and records the exact tokens the policy produced, so the cost is charged
where the calls are executed and counted once, and a turn-context prompt (rebuilt every turn from the workspace) is
what the policy read. The samples are built in ``evoharness.rollouts``.

The path from rollout to loss (GRPO: Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300):
1. rollout: each prompt (a game's first observation) is played ``num_generations`` times -> a group (``turn``
   context: ``turns_per_episode`` turns of each episode are the group's samples);
2. reward: ``won - cost`` with cost = per-call price of each *executed* meta-action + per-token price of the
   calls' arguments and results + per-token price of everything the policy generated (``EpisodeUsage.cost``);
3. advantage: TRL normalises rewards within each group; the loss uses generated tokens only (``env_mask``).

Per step it logs to MLflow: success rate, reward, cost, meta-actions per episode by type (the annealing curve),
environment steps, generated tokens and rendered workspace tokens (harness evolution).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from evoharness.config import CostConfig, GRPOStageConfig, TraceConfig
from evoharness.rollouts import HarnessRollouts, TurnRollouts, build_prompts


def episode_reward(prompts, completions, episode_reward, **kwargs) -> list[float]:
    """TRL reward function: the ``won - cost`` computed by the policy loop for each rollout."""
    return list(episode_reward)


def train_grpo(model_path: str, games: list[str], output_dir: str, cfg: GRPOStageConfig, cost: CostConfig,
               experience_path: str, data_dir: str | None = None, workspace_cfg: TraceConfig | None = None) -> dict:
    """Run cost-aware GRPO from ``model_path``; returns the final path and the first/last step's metrics.

    Checkpoints go to ``output_dir/checkpoints`` and a re-run resumes from the last one.
    """
    import torch
    from datasets import Dataset
    from transformers.trainer_utils import get_last_checkpoint
    from trl import GRPOConfig, GRPOTrainer

    from evoharness.model import load_policy

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows, by_obs = build_prompts(games, data_dir)
    model, tokenizer = load_policy(model_path)
    ckpt_dir = out / "checkpoints"
    turn = workspace_cfg is not None and workspace_cfg.context == "turn"
    group = cfg.num_generations * (cfg.turns_per_episode if turn else 1)  # samples per game per step
    on_gpu = torch.cuda.is_available()
    args = GRPOConfig(
        output_dir=str(ckpt_dir), per_device_train_batch_size=cfg.prompts_per_step * group,
        gradient_accumulation_steps=1, num_generations=group, max_steps=cfg.max_steps,
        learning_rate=cfg.learning_rate, beta=cfg.beta, temperature=max(cfg.temperature, 1e-3),
        max_completion_length=model.config.max_position_embeddings, logging_steps=1,
        save_steps=cfg.save_steps, seed=cfg.seed, use_cpu=not on_gpu, bf16=cfg.bf16 and on_gpu,
        report_to=["mlflow"] if os.environ.get("MLFLOW_RUN_ID") else "none", disable_tqdm=False,
    )
    rollout_cls = TurnRollouts if turn else HarnessRollouts
    rollouts = rollout_cls(by_obs, cfg, cost, experience_path, str(out / "history.jsonl"), data_dir, workspace_cfg)
    trainer = GRPOTrainer(model=model, reward_funcs=[episode_reward], args=args,
                          train_dataset=Dataset.from_list(rows), processing_class=tokenizer, rollout_func=rollouts)
    last = get_last_checkpoint(str(ckpt_dir)) if ckpt_dir.exists() else None
    trainer.train(resume_from_checkpoint=last)
    final = out / "final"
    trainer.save_model(str(final))
    tokenizer.save_pretrained(str(final))
    by_step = {}  # a resumed run may have logged a step twice: keep the last
    for line in (out / "history.jsonl").read_text().splitlines():
        by_step[json.loads(line)["step"]] = json.loads(line)
    history = [by_step[k] for k in sorted(by_step)]
    return {"final_path": str(final), "global_step": trainer.state.global_step, "resumed_from": last,
            "first": history[0], "last": history[-1], "steps_logged": len(history)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spec", required=True,
                        help="JSON file: model_path, games, output_dir, experience_path, grpo, cost, data_dir")
    spec = json.loads(Path(parser.parse_args(argv).spec).read_text())
    result = train_grpo(spec["model_path"], spec["games"], spec["output_dir"], GRPOStageConfig(**spec["grpo"]),
                        CostConfig(**spec["cost"]), spec["experience_path"], spec.get("data_dir"),
                        TraceConfig(**spec["traces"]) if spec.get("traces") else None)
    Path(spec["output_dir"], "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
