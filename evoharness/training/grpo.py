"""Cost-aware GRPO with TRL's ``GRPOTrainer`` on multi-turn ALFWorld episodes played through the harness.

Why ``rollout_func`` rather than ``environment_factory``: the episode is played by the same policy loop as
evaluation (``evoharness.policy.agent.run_episode`` with ``LMPolicy``), which turns ``act`` into an admissible command,
runs meta-actions against the ``Workspace`` and records the exact tokens the policy produced, so the cost is charged
where the calls are executed and counted once, and a turn-context prompt (rebuilt every turn from the workspace) is
what the policy read. The samples are built in ``evoharness.training.rollouts``.

The path from rollout to loss (GRPO: Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300):
1. rollout: each prompt (a game's first observation) is played ``num_generations`` times -> a group (``turn``
   context: ``turns_per_episode`` turns of each episode are the group's samples);
2. reward (``evoharness.training.reward``, ``cost.mode``): ``priced`` (the default): ``won - cost`` with cost = per-call
   price of each *executed* meta-action + per-token price of the calls' arguments and results + per-token price of
   everything the policy generated + a price per turn the harness rejected: malformed output, unknown tool, invalid
   or refused meta-action (``EpisodeUsage.cost``). ``budget``: the paper's (EvoHarness-RL, arXiv:2608.05446)
   task + efficiency + annealed diversity - spam - invalid terms, with environment actions and meta-action calls
   sharing one interaction budget; the priced cost is still computed and logged;
3. advantage: TRL normalises rewards within each group; with ``grpo.turns_per_group`` every turn carries its own
   advantage instead (GRPO's episode-level one, or GiGPO's: ``evoharness.training.advantages``), which TRL uses
   unscaled; the loss uses generated tokens only (``env_mask``).

Per step it logs to MLflow: success rate, reward and each of its terms (``reward_task``, ``reward_eff``,
``reward_div``, ``lambda_div``, ``reward_spam``, ``reward_inv``, ``reward_cost``), the priced cost (``cost``, charged or
not), meta-actions per episode by type (the annealing curve), environment steps, generated tokens and rendered
workspace tokens (harness evolution).
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from pathlib import Path

from evoharness.config import CostConfig, GRPOStageConfig, TraceConfig
from evoharness.training.rollouts import HarnessRollouts, TurnRollouts, build_prompts, read_history


def episode_reward(prompts, completions, episode_reward, **kwargs) -> list[float]:
    """TRL reward function: the reward the policy loop computed for each rollout (``EpisodeResult.reward``: under
    ``cost.mode``, ``won - cost`` or the paper's budget reward)."""
    return list(episode_reward)


def train_grpo(model_path: str, games: list[str], output_dir: str, cfg: GRPOStageConfig, cost: CostConfig,
               experience_path: str, data_dir: str | None = None, workspace_cfg: TraceConfig | None = None) -> dict:
    """Run cost-aware GRPO from ``model_path``; returns the final path, the world size and the first/last step's
    metrics (on the main process; {} on the others).

    Run under ``accelerate launch`` with any number of processes: each plays ``prompts_per_step / world size`` games
    per step (see ``GRPOStageConfig.num_processes``). Checkpoints go to ``output_dir/checkpoints`` and a re-run
    resumes from the last one. Raises ValueError when ``prompts_per_step`` is not a multiple of the world size.
    """
    import torch
    from datasets import Dataset
    from transformers.trainer_utils import get_last_checkpoint
    from trl import GRPOConfig, GRPOTrainer

    from evoharness.training.model import load_policy, lora_config, save_final

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    # TRL reads transformers' deprecated `is_gradient_checkpointing` whenever it unwraps the model to generate
    # (trl/models/utils.py); nothing a user can change, so its FutureWarning is not shown
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    world = int(os.environ.get("WORLD_SIZE", "1"))  # set by accelerate launch (torchrun); before any Accelerator
    if cfg.prompts_per_step % world:
        raise ValueError(f"grpo.prompts_per_step ({cfg.prompts_per_step}) is not a multiple of the {world} "
                         "processes: each process plays whole groups")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows, by_obs = build_prompts(games, data_dir)
    model, tokenizer = load_policy(model_path, dtype=cfg.model_dtype)
    peft_config = lora_config(cfg)
    ckpt_dir = out / "checkpoints"
    turn = workspace_cfg is not None and workspace_cfg.context == "turn"
    if cfg.turns_per_group and not turn:
        raise ValueError("grpo.turns_per_group needs the turn context (traces.context: turn)")
    own_advantages = turn and cfg.turns_per_group > 0  # rollouts.advantage_samples computes them per turn
    group = (cfg.turns_per_group if own_advantages
             else cfg.num_generations * (cfg.turns_per_episode if turn else 1))  # samples per game per step
    per_process = cfg.prompts_per_step // world * group  # samples a process trains on per step
    micro = cfg.micro_batch_size or per_process
    if per_process % micro:
        raise ValueError(f"grpo.micro_batch_size ({micro}) does not divide the {per_process} samples each process "
                         f"trains on per step ({cfg.prompts_per_step // world} group(s) of {group}): pick a divisor")
    on_gpu = torch.cuda.is_available()
    if cfg.use_vllm and not (on_gpu and turn):
        raise ValueError("grpo.use_vllm needs CUDA GPUs (vLLM colocate mode) and the turn context; set it to false")
    args = GRPOConfig(
        output_dir=str(ckpt_dir), per_device_train_batch_size=micro,
        gradient_accumulation_steps=per_process // micro, steps_per_generation=per_process // micro,
        num_generations=group, max_steps=cfg.max_steps,
        learning_rate=cfg.learning_rate, beta=cfg.beta, temperature=max(cfg.temperature, 1e-3),
        scale_rewards="none" if own_advantages else "group",  # advantages computed per turn are used as they are
        max_completion_length=model.config.max_position_embeddings, logging_steps=1,
        save_steps=cfg.save_steps, seed=cfg.seed, use_cpu=not on_gpu, bf16=cfg.bf16 and on_gpu,
        activation_checkpointing=cfg.gradient_checkpointing,  # transformers 5 name (the old one warns)
        use_vllm=cfg.use_vllm, vllm_mode="colocate", vllm_gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
        # score decoding draws a command from the softmax over candidates, so the tokens' recorded log-probabilities
        # are not vLLM's sampling probabilities: TRL's vLLM importance-sampling correction would reweight wrongly
        vllm_importance_sampling_correction=False,
        report_to=["mlflow"] if os.environ.get("MLFLOW_RUN_ID") else "none", disable_tqdm=False,
    )
    rollout_cls = TurnRollouts if turn else HarnessRollouts
    rollouts = rollout_cls(by_obs, cfg, cost, experience_path, str(out / "history.jsonl"), data_dir, workspace_cfg)
    trainer = GRPOTrainer(model=model, reward_funcs=[episode_reward], args=args,
                          train_dataset=Dataset.from_list(rows), processing_class=tokenizer, rollout_func=rollouts,
                          peft_config=peft_config)
    last = get_last_checkpoint(str(ckpt_dir)) if ckpt_dir.exists() else None
    trainer.train(resume_from_checkpoint=last)
    final = out / "final"
    save_final(trainer, tokenizer, final, merge_lora=peft_config is not None)
    if not trainer.accelerator.is_main_process:  # only the main process writes the history and the result
        return {}
    history = read_history(out / "history.jsonl")
    return {"final_path": str(final), "global_step": trainer.state.global_step, "resumed_from": last,
            "world_size": world, "first": history[0], "last": history[-1], "steps_logged": len(history)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spec", required=True,
                        help="JSON file: model_path, games, output_dir, experience_path, grpo, cost, data_dir")
    spec = json.loads(Path(parser.parse_args(argv).spec).read_text())
    result = train_grpo(spec["model_path"], spec["games"], spec["output_dir"], GRPOStageConfig(**spec["grpo"]),
                        CostConfig(**spec["cost"]), spec["experience_path"], spec.get("data_dir"),
                        TraceConfig(**spec["traces"]) if spec.get("traces") else None)
    if result:  # the main process
        Path(spec["output_dir"], "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
