"""TRL ``rollout_func`` implementations: ALFWorld episodes played through the harness, returned as GRPO samples.

Two layouts, one per context (``TraceConfig.context``):

* ``HarnessRollouts`` (``history``): one sample per episode, the whole episode as one token sequence with
  ``env_mask`` 0 on the tool responses (TRL's multi-turn ``rollout_func`` example layout).
* ``TurnRollouts`` (``turn``): every turn has its own prompt (task, workspace, recent commands, observation), so an
  episode is not one sequence. A GRPO group is ``num_generations`` episodes of the same game; from each episode
  ``turns_per_episode`` turns are drawn (uniformly, without replacement while it has enough), and each drawn turn is
  one sample: that turn's prompt, the tokens the policy produced, and the episode's reward (``won - cost``, or the
  paper's budget reward with ``cost.mode: budget``: ``evoharness.training.reward``). TRL
  normalises rewards within a group of ``num_generations x turns_per_episode`` samples, so every turn of an episode
  gets the episode's advantage: the episode-level credit assignment of GRPO (Shao et al. 2024, arXiv:2402.03300)
  applied to turn-wise prompts. Sampling a few turns per episode keeps a step's batch bounded however long the
  episodes run. With ``grpo.turns_per_group`` every turn of the group's episodes is a sample instead, each with its
  own advantage (``advantage_samples``: GRPO's episode-level one, or GiGPO's with a step-level term,
  ``evoharness.training.advantages``).

Both log the same per-step metrics (``episode_metrics``) to ``history.jsonl`` and MLflow. With ``cost.mode:
budget`` an episode plays under the shared interaction budget ``T_max`` instead of ``grpo.max_env_steps`` and
``grpo.max_meta_actions`` (``evoharness.training.reward.episode_budgets``), and its reward's diversity weight is the one
at the trainer's current step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
from pathlib import Path

from evoharness.config import CostConfig, GRPOStageConfig, TraceConfig
from evoharness.harness.workspace import META_ACTIONS, SYSTEM_PROMPT, TOOLS, ExperienceStore, Workspace
from evoharness.training.reward import episode_budgets

# the reward's terms (evoharness.training.reward.RewardParts) logged per step, by metric name: in both modes they sum to
# ``reward``; ``reward_cost`` is the priced cost as charged (0 in budget mode), ``cost`` the priced cost either way
REWARD_METRICS = {"reward_task": "task", "reward_eff": "efficiency", "reward_div": "diversity",
                  "lambda_div": "lambda_div", "reward_spam": "spam", "reward_inv": "invalid", "reward_cost": "cost"}


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
        "rejected_turns": sum(r.rejected_turns for r in results) / n,
        "workspace_tokens": sum(max(r.workspace_tokens or [0]) for r in results) / n,
        "meta_actions": sum(sum(r.meta_actions.values()) for r in results) / n,
        "meta_calls": sum(r.meta_calls for r in results) / n,
        "repeats": sum(r.repeats for r in results) / n,
        "invalid_actions": sum(r.invalid_actions for r in results) / n,
    }
    for name, part in REWARD_METRICS.items():
        out[name] = sum(r.reward_parts.get(part, 0.0) for r in results) / n
    for m in META_ACTIONS:
        out[f"meta_actions_{m}"] = sum(r.meta_actions.get(m, 0) for r in results) / n
        out[f"cost_{m}"] = sum(r.cost_by_type.get(m, 0.0) for r in results) / n
    return out


def build_prompts(games: list[str], data_dir: str | None = None) -> tuple[list[dict], dict[str, str]]:
    """One conversational prompt per game (system + first observation) and a map from observation to game."""
    from evoharness.env.alfworld import ALFWorldEnv

    rows, by_obs = [], {}
    for game in games:
        env = ALFWorldEnv(game, expert=False, data_dir=data_dir)
        obs = env.reset().observation
        env.close()
        rows.append({"prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": obs}]})
        by_obs[obs] = game
    return rows, by_obs


class _Rollouts:
    """What both ``rollout_func`` layouts hold: the games by first observation, settings, the shared Experience
    store, the per-step history file and the number of calls so far (seeds and episode ids)."""

    def __init__(self, by_obs: dict[str, str], cfg: GRPOStageConfig, cost: CostConfig, experience_path: str,
                 history_path: str, data_dir: str | None = None, workspace_cfg: TraceConfig | None = None):
        self.by_obs, self.cfg, self.cost = by_obs, cfg, cost
        self.workspace_cfg = workspace_cfg or TraceConfig(context=self.context)
        self.experience = ExperienceStore(experience_path)
        self.history_path = Path(history_path)
        self.data_dir = data_dir
        self.calls = 0

    def budgets(self) -> tuple[int, int, int | None]:
        """(environment steps, meta-actions, shared interaction budget) of a rollout episode under ``cost.mode``."""
        return episode_budgets(self.cost, self.cfg.max_env_steps, self.cfg.max_meta_actions)

    def episode_seed(self, index: int) -> int:
        """The seed of the ``index``-th episode of this call's step (numbered over all processes): distinct for
        every episode of every step."""
        return self.cfg.seed + self.calls * self.cfg.prompts_per_step * self.cfg.num_generations + index



class HarnessRollouts(_Rollouts):
    """TRL ``rollout_func``: plays one episode per prompt entry and returns tokens, logprobs, env_mask, rewards."""

    context = "history"

    def __call__(self, prompts: list, trainer) -> dict:
        from evoharness.env.alfworld import ALFWorldEnv
        from evoharness.policy.agent import run_episode
        from evoharness.policy.lm_policy import LMPolicy

        model = trainer.accelerator.unwrap_model(trainer.model)
        tokenizer = trainer.processing_class
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": [], "episode_reward": []}
        results, t0 = [], time.time()
        first = trainer.accelerator.process_index * len(prompts)  # this process's episodes, numbered step-wide
        env_steps, meta_actions, shared = self.budgets()
        for i, prompt in enumerate(prompts, start=first):
            game = self.by_obs[prompt[-1]["content"]]
            env = ALFWorldEnv(game, max_steps=env_steps + 1, expert=False, data_dir=self.data_dir)
            policy = LMPolicy(model, tokenizer, self.cfg.max_new_tokens, self.cfg.temperature)
            ws = Workspace.from_config(self.experience, f"grpo-{self.calls}-{i}", self.workspace_cfg)
            seed = self.episode_seed(i)
            res = run_episode(env, policy, ws, self.cost, env_steps, meta_actions, seed, interaction_budget=shared,
                              update=trainer.state.global_step)
            env.close()
            results.append(res)
            rollout = policy.rollout() if getattr(policy, "prompt_ids", None) else {}
            if not any(rollout.get("env_mask", [])):  # reset failed or nothing generated: one masked token
                rollout = empty_turn(tokenizer, prompt, TOOLS) | (
                    {"prompt_ids": rollout["prompt_ids"]} if rollout.get("prompt_ids") else {})
            for k, v in rollout.items():
                out[k].append(v)
            out["episode_reward"].append(res.reward)
        log_step(results, t0, trainer, self.history_path)
        self.calls += 1
        return out


class TurnRollouts(_Rollouts):
    """TRL ``rollout_func`` for the ``turn`` context: ``num_generations`` episodes per game, ``turns_per_episode``
    sampled turns per episode, each turn one GRPO sample (see the module docstring).

    The prompts TRL passes come in groups of ``num_generations x turns_per_episode`` copies of a game's first
    observation (``GRPOConfig.num_generations`` is that product). Environment actions are decoded with ``score``
    decoding, sampled from the softmax over the admissible commands' log-likelihoods at the rollout temperature, so
    every executed command is admissible; meta-actions are sampled token by token.
    """

    context = "turn"

    def play(self, model, tokenizer, game: str, episode_id: str, seed: int, generate_fn=None,
             update: int | None = None, lane=None):
        """One sampled episode of ``game``; returns (EpisodeResult, the policy's recorded turns). ``seed`` seeds the
        game and torch's sampler: with ``model.generate`` an episode's draws do not depend on which process plays it
        (what it reads from the shared Experience store still can). ``generate_fn``: ``LMPolicy``'s generation
        backend (None: ``model.generate``; vLLM keeps its own per-process sampler state). ``update``: the GRPO step
        the reward's diversity weight is taken at (``cost.mode: budget``). ``lane``: an
        ``evoharness.policy.batched_play.Lane``: the game runs in the lane's environment process, the model calls go
        through its batch engine, and the lane's own Experience store connection is used (torch's sampler is then shared
        by the batch and not seeded here)."""
        import torch

        from evoharness.env.alfworld import ALFWorldEnv
        from evoharness.harness.context import turn_view
        from evoharness.policy.agent import run_episode
        from evoharness.policy.lm_policy import LMPolicy

        wcfg = self.workspace_cfg
        env_steps, meta_actions, shared = self.budgets()
        env = (lane.make_env if lane else ALFWorldEnv)(game, env_steps + 1, False, self.data_dir)
        policy = LMPolicy(model, tokenizer, self.cfg.max_new_tokens, self.cfg.temperature, context="turn",
                          decoding="score", tools=TOOLS if wcfg.tools_in_prompt else None, generate_fn=generate_fn,
                          act_each_turn=wcfg.parallel_calls,  # as evaluation plays it (EvalConfig.act_each_turn)
                          ground_track=self.cfg.ground_track, engine=lane.engine if lane else None)
        store = self.experience
        if lane is not None:  # sqlite connections belong to the thread that opened them
            if "store" not in lane.state:
                lane.state["store"] = ExperienceStore(self.experience.path)
            store = lane.state["store"]
        ws = Workspace.from_config(store, episode_id, wcfg)
        if lane is None:
            torch.manual_seed(seed)
        try:
            res = run_episode(env, policy, ws, self.cost, env_steps, meta_actions, seed, view=turn_view(wcfg),
                              interaction_budget=shared, update=update)
        finally:
            env.close()
        return res, getattr(policy, "turns", [])

    def __call__(self, prompts: list, trainer) -> dict:
        import torch

        model = trainer.accelerator.unwrap_model(trainer.model)
        tokenizer = trainer.processing_class
        per_episode = self.cfg.turns_per_episode
        group = self.cfg.turns_per_group or self.cfg.num_generations * per_episode
        if len(prompts) % group:
            raise ValueError(f"rollout_func got {len(prompts)} prompts, not a multiple of the group size {group} "
                             "(grpo.turns_per_group, or num_generations x turns_per_episode)")
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": [], "episode_reward": []}
        results, t0 = [], time.time()
        first_group = trainer.accelerator.process_index * (len(prompts) // group)  # groups numbered step-wide
        generate_fn = vllm_generate_fn(trainer) if getattr(trainer, "use_vllm", False) else None
        was_training = model.training
        model.eval()  # no dropout, and the KV cache that score decoding reuses (off under gradient checkpointing)
        try:
            jobs = [(g, start, e) for g, start in enumerate(range(0, len(prompts), group), start=first_group)
                    for e in range(self.cfg.num_generations)]

            def play(job, lane=None):
                g, start, e = job
                game = self.by_obs[prompts[start][-1]["content"]]  # g: the group's index in the whole step
                seed = self.episode_seed(g * self.cfg.num_generations + e)
                return self.play(model, tokenizer, game, f"grpo-{self.calls}-{g}-{e}", seed, generate_fn,
                                 update=trainer.state.global_step, lane=lane)

            with torch.no_grad():
                if self.cfg.batch_episodes > 1 and generate_fn is None:
                    from evoharness.policy.batched_play import run_lanes

                    played = run_lanes(model, tokenizer, jobs, self.cfg.batch_episodes, 50, play)
                else:
                    played = [play(job) for job in jobs]
            dropped = trained = 0
            for i in range(0, len(jobs), self.cfg.num_generations):  # one game's episodes: a group
                (g, start, _), episodes = jobs[i], played[i:i + self.cfg.num_generations]
                results += [res for res, _ in episodes]
                pad = empty_turn(tokenizer, prompts[start])
                if self.cfg.turns_per_group:
                    samples, values, n_dropped = advantage_samples(episodes, self.cfg, pad,
                                                                   self.episode_seed(g * self.cfg.num_generations))
                    dropped, trained = dropped + n_dropped, trained + sum(t is not pad for t in samples)
                else:
                    samples, values = [], []
                    for e, (res, turns) in enumerate(episodes):
                        seed = self.episode_seed(g * self.cfg.num_generations + e)
                        picked = sample_turns(turns, per_episode, seed)
                        trained += len(picked)
                        samples += picked or [pad] * per_episode
                        values += [res.reward] * per_episode
                for t, v in zip(samples, values):
                    for k in ("prompt_ids", "completion_ids", "logprobs", "env_mask"):
                        out[k].append(t[k])
                    out["episode_reward"].append(v)
        finally:
            model.train(was_training)
        log_step(results, t0, trainer, self.history_path, {"turns_trained": trained, "turns_dropped": dropped})
        self.calls += 1
        return out


def vllm_generate_fn(trainer):
    """``LMPolicy``'s ``generate_fn`` over TRL's vLLM engine (``GRPOConfig(use_vllm=True, vllm_mode="colocate")``):
    TRL syncs the policy's weights into vLLM before every ``rollout_func`` call (``GRPOTrainer._generate``); each
    call samples one turn of at most ``max_new_tokens`` at the trainer's temperature and returns (ids, log-probs).

    Colocate mode only (one engine per process, tensor parallel 1): in server mode every call is a collective over
    all processes, and the processes' episodes have different numbers of turns. GPU only; not run on CPU machines.
    """
    engine = trainer.vllm_generation

    def generate(prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
        engine.max_completion_length = max_new_tokens  # per call: a turn, not the whole completion budget
        _, completion_ids, logprobs, _ = engine.generate([prompt_ids], None, 1)
        return completion_ids[0], [lp[0] for lp in logprobs[0]]

    return generate


def advantage_samples(episodes: list[tuple], cfg: GRPOStageConfig, pad: dict,
                      seed: int) -> tuple[list[dict], list[float], int]:
    """One group's GRPO samples when every turn is trained (``grpo.turns_per_group``): each recorded turn of the
    group's episodes with its own advantage (``evoharness.training.advantages.turn_advantages`` under
    ``grpo.advantage``).

    ``episodes``: (``EpisodeResult``, its recorded turns) per episode of one game. ``pad``: a masked sample (nothing
    to learn from) that fills the group to ``turns_per_group`` rows. Returns (samples, values, dropped): ``values``
    are what the reward function hands TRL, which subtracts the group's mean and, with ``scale_rewards="none"``,
    nothing else: the turns' advantages, then one pad row holding minus their sum, then 0 for the other pad rows, so
    the group's mean is 0 and TRL's baseline changes nothing; the pad rows are masked, so their advantage trains
    nothing. (None would also be left out of TRL's mean, but TRL warns about every such row at every step.) When the
    turns exceed ``turns_per_group - 1``, that many
    are drawn uniformly (``seed``) and ``dropped`` counts the rest."""
    from evoharness.training.advantages import turn_advantages

    anchors = [[t.get("anchor") for t in turns] for _, turns in episodes]
    advantages = turn_advantages(anchors, [res.reward for res, _ in episodes], cfg.advantage, cfg.gigpo_gamma,
                                 cfg.gigpo_omega)
    rows = [(t, a) for (_, turns), per_turn in zip(episodes, advantages) for t, a in zip(turns, per_turn)]
    room = cfg.turns_per_group - 1
    dropped = max(len(rows) - room, 0)
    if dropped:
        rows = [rows[i] for i in sorted(random.Random(seed).sample(range(len(rows)), room))]
    n_pad = cfg.turns_per_group - len(rows)
    samples = [t for t, _ in rows] + [pad] * n_pad
    values = [a for _, a in rows] + [-sum(a for _, a in rows)] + [0.0] * (n_pad - 1)
    return samples, values, dropped


def sample_turns(turns: list[dict], k: int, seed: int) -> list[dict]:
    """``k`` of an episode's recorded turns, uniformly without replacement (with replacement when it has fewer
    than ``k``); [] when it has none."""
    if not turns:
        return []
    rng = random.Random(seed)
    return rng.sample(turns, k) if len(turns) >= k else [rng.choice(turns) for _ in range(k)]


def empty_turn(tokenizer, prompt: list[dict], tools: list[dict] | None = None) -> dict:
    """A sample with nothing to learn from (one masked end token) for an episode that played no turn or generated
    nothing (its reset failed): it still fills its place in the group."""
    ids = tokenizer.apply_chat_template(prompt, tools=tools, add_generation_prompt=True, tokenize=True,
                                        return_dict=True)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return {"prompt_ids": ids["input_ids"], "completion_ids": [end], "logprobs": [0.0], "env_mask": [0]}


def log_step(results, t0: float, trainer, history_path: Path, counts: dict | None = None) -> dict:
    """Gather the step's episodes from every process; on the main process append their ``episode_metrics`` (with
    the episode count, rollouts per minute over the step's wall time and ``counts`` summed over the processes,
    e.g. turns trained and dropped) to ``history_path`` and MLflow, print them and return them ({} on the other
    processes)."""
    import mlflow

    counts = counts or {}
    if trainer.accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        results = gather_object([dataclasses.replace(r, transcript=[]) for r in results])  # no need to ship turns
        gathered = gather_object([counts])
        counts = {k: sum(c.get(k, 0) for c in gathered) for k in counts}
    if not trainer.accelerator.is_main_process:
        return {}
    metrics = episode_metrics(results) | counts | {
        "episodes": len(results), "rollouts_per_min": len(results) / max(time.time() - t0, 1e-9) * 60}
    step = trainer.state.global_step
    with history_path.open("a") as fh:
        fh.write(json.dumps({"step": step, **metrics}) + "\n")
    if mlflow.active_run() is not None or os.environ.get("MLFLOW_RUN_ID"):
        mlflow.log_metrics({f"rollout/{k}": v for k, v in metrics.items()}, step=step,
                           run_id=os.environ.get("MLFLOW_RUN_ID"))
    print(f"[grpo] step {step}: success {metrics['success_rate']:.2f} reward {metrics['reward']:.3f} "
          f"cost {metrics['cost']:.3f} meta/ep {metrics['meta_actions']:.1f} "
          f"({metrics['rollouts_per_min']:.1f} rollouts/min)", flush=True)
    return metrics


def read_history(path: str | Path) -> list[dict]:
    """The per-step metrics ``log_step`` appended to ``path``, one dict per step in step order. A resumed run may
    have logged a step twice (its rollouts were played again): the last entry wins."""
    by_step = {}
    for line in Path(path).read_text().splitlines():
        entry = json.loads(line)
        by_step[entry["step"]] = entry
    return [by_step[k] for k in sorted(by_step)]
