"""Cost-aware GRPO with TRL's ``GRPOTrainer`` on multi-turn ALFWorld episodes played through the harness.

Why ``rollout_func`` rather than ``environment_factory``: the episode is played by the same policy loop as
evaluation (``evoharness.agent.run_episode`` with ``LMPolicy``), which maps ``act`` to admissible commands, runs
meta-actions against the ``Workspace`` and returns the exact token sequence with ``env_mask`` (1 = generated,
0 = tool response), so the cost is charged where the calls are executed and counted once.

The path from rollout to loss (GRPO: Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300):
1. rollout: each prompt (a game's first observation) is played ``num_generations`` times -> a group;
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
import time
from pathlib import Path

from evoharness.config import CostConfig, GRPOStageConfig, TraceConfig
from evoharness.harness import META_ACTIONS, SYSTEM_PROMPT, TOOLS, ExperienceStore, Workspace


def episode_metrics(results) -> dict:
    """Means over a batch of ``EpisodeResult``: the quantities that explain annealing and evolution."""
    n = max(len(results), 1)
    out = {
        "success_rate": sum(r.won for r in results) / n,
        "reward": sum(r.reward for r in results) / n,
        "cost": sum(r.cost for r in results) / n,
        "env_steps": sum(r.env_steps for r in results) / n,
        "generated_tokens": sum(r.generated_tokens for r in results) / n,
        "malformed": sum(r.malformed for r in results) / n,
        "workspace_tokens": sum(max(r.workspace_tokens or [0]) for r in results) / n,
        "meta_actions": sum(sum(r.meta_actions.values()) for r in results) / n,
    }
    for m in META_ACTIONS:
        out[f"meta_actions_{m}"] = sum(r.meta_actions.get(m, 0) for r in results) / n
        out[f"cost_{m}"] = sum(r.cost_by_type.get(m, 0.0) for r in results) / n
    return out


def build_prompts(games: list[str], data_dir: str | None = None) -> tuple[list[dict], dict[str, str]]:
    """One conversational prompt per game (system + first observation) and a map from observation to game."""
    from evoharness.alfworld_env import ALFWorldEnv

    rows, by_obs = [], {}
    for game in games:
        env = ALFWorldEnv(game, expert=False, data_dir=data_dir)
        obs = env.reset().observation
        env.close()
        rows.append({"prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": obs}]})
        by_obs[obs] = game
    return rows, by_obs


class HarnessRollouts:
    """TRL ``rollout_func``: plays one episode per prompt entry and returns tokens, logprobs, env_mask, rewards."""

    def __init__(self, by_obs: dict[str, str], cfg: GRPOStageConfig, cost: CostConfig, experience_path: str,
                 history_path: str, data_dir: str | None = None, workspace_cfg: TraceConfig | None = None):
        self.by_obs, self.cfg, self.cost = by_obs, cfg, cost
        self.workspace_cfg = workspace_cfg or TraceConfig()
        self.experience = ExperienceStore(experience_path)
        self.history_path = Path(history_path)
        self.data_dir = data_dir
        self.calls = 0

    def __call__(self, prompts: list, trainer) -> dict:
        import mlflow

        from evoharness.agent import run_episode
        from evoharness.alfworld_env import ALFWorldEnv
        from evoharness.lm_policy import LMPolicy

        model = trainer.accelerator.unwrap_model(trainer.model)
        tokenizer = trainer.processing_class
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": [], "episode_reward": []}
        results, t0 = [], time.time()
        for i, prompt in enumerate(prompts):
            game = self.by_obs[prompt[-1]["content"]]
            env = ALFWorldEnv(game, max_steps=self.cfg.max_env_steps + 1, expert=False, data_dir=self.data_dir)
            policy = LMPolicy(model, tokenizer, self.cfg.max_new_tokens, self.cfg.temperature)
            ws = Workspace.from_config(self.experience, f"grpo-{self.calls}-{i}", self.workspace_cfg)
            seed = self.cfg.seed + 1000 * self.calls + i
            res = run_episode(env, policy, ws, self.cost, self.cfg.max_env_steps, self.cfg.max_meta_actions, seed)
            env.close()
            results.append(res)
            rollout = policy.rollout() if getattr(policy, "prompt_ids", None) else {}
            if not any(rollout.get("env_mask", [])):  # reset failed or nothing generated: one masked token
                prompt_ids = rollout.get("prompt_ids") or tokenizer.apply_chat_template(
                    prompt, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
                rollout = {"prompt_ids": prompt_ids, "completion_ids": [policy.end_id], "logprobs": [0.0],
                           "env_mask": [0]}
            for k, v in rollout.items():
                out[k].append(v)
            out["episode_reward"].append(res.reward)
        metrics = episode_metrics(results) | {"rollouts_per_min": len(results) / max(time.time() - t0, 1e-9) * 60}
        step = trainer.state.global_step
        with self.history_path.open("a") as fh:
            fh.write(json.dumps({"step": step, **metrics}) + "\n")
        if mlflow.active_run() is not None or os.environ.get("MLFLOW_RUN_ID"):
            mlflow.log_metrics({f"rollout/{k}": v for k, v in metrics.items()}, step=step,
                               run_id=os.environ.get("MLFLOW_RUN_ID"))
        print(f"[grpo] step {step}: success {metrics['success_rate']:.2f} reward {metrics['reward']:.3f} "
              f"cost {metrics['cost']:.3f} meta/ep {metrics['meta_actions']:.1f} "
              f"({metrics['rollouts_per_min']:.1f} rollouts/min)", flush=True)
        self.calls += 1
        return out


def episode_reward(prompts, completions, episode_reward, **kwargs) -> list[float]:
    """TRL reward function: the ``won - cost`` computed by the policy loop for each rollout."""
    return list(episode_reward)


def train_grpo(model_path: str, games: list[str], output_dir: str, cfg: GRPOStageConfig, cost: CostConfig,
               experience_path: str, data_dir: str | None = None, workspace_cfg: TraceConfig | None = None) -> dict:
    """Run cost-aware GRPO from ``model_path``; returns the final path and the first/last step's metrics.

    Checkpoints go to ``output_dir/checkpoints`` and a re-run resumes from the last one.
    """
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
    args = GRPOConfig(
        output_dir=str(ckpt_dir), per_device_train_batch_size=cfg.prompts_per_step * cfg.num_generations,
        gradient_accumulation_steps=1, num_generations=cfg.num_generations, max_steps=cfg.max_steps,
        learning_rate=cfg.learning_rate, beta=cfg.beta, temperature=max(cfg.temperature, 1e-3),
        max_completion_length=model.config.max_position_embeddings, logging_steps=1,
        save_steps=cfg.save_steps, seed=cfg.seed, use_cpu=True, bf16=False,
        report_to=["mlflow"] if os.environ.get("MLFLOW_RUN_ID") else "none", disable_tqdm=False,
    )
    rollouts = HarnessRollouts(by_obs, cfg, cost, experience_path, str(out / "history.jsonl"), data_dir,
                               workspace_cfg)
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
