"""The episode reward GRPO trains on, in two conventions (``CostConfig.mode``).

* ``priced`` (ours, the default): ``R = won - cost``, where ``cost`` prices every executed meta-action, the tokens
  of calls and results, every generated token and every rejected turn (``EpisodeUsage.cost``).
* ``budget`` (the paper's): meta-actions draw on the same interaction budget ``T_max`` as environment actions, so
  an unneeded call costs what a redundant environment action costs::

      R = task_reward * 1[won] + lambda_eff * 1[won] * max(0, T_max - |tau|) / T_max + lambda_div(u) * R_div
          - lambda_spam * min(S, C_spam) - lambda_inv * I  [ - cost, with ``charge_priced`` (not the paper's) ]

  Source: EvoHarness-RL (Ning et al. 2026, arXiv:2608.05446), its README ("GRPO training") and
  ``evoharness/rl/reward.py``; the defaults of the weights come from its ``configs/train/common.yaml`` and
  ``configs/train/alfworld.yaml`` (see ``CostConfig``).

What each symbol counts here, from what ``evoharness.policy.agent.run_episode`` already records:

* ``|tau|`` (``Interaction.steps_used``): environment actions plus meta-action calls, one unit per call even when a
  turn holds several (parallel calls). A meta-action call counts whether it ran, failed its schema, was refused or
  named an unknown tool, and the closing ``note`` counts too (so ``|tau|`` can pass ``T_max`` by the closing turn;
  the efficiency term is floored at 0). With ``charge_meta_actions: false`` only environment actions count.
* ``R_div`` (``types_share``): the share of the four meta-action types (``track``, ``commit``, ``recall``,
  ``note``) with at least one *executed* call: 0, 0.25, 0.5, 0.75 or 1. A call that failed or was refused did not
  use the workspace, and it is already charged by ``I``.
* ``S`` (``count_repeats``): calls identical to the call just before them (``action_key``: the executed command
  of an act, or the tool name and its arguments), over the episode's calls in order.
* ``I`` (``Interaction.invalid``): turns the harness rejected (``EpisodeUsage.rejected_turns``: malformed output,
  unknown tools, meta-actions whose arguments fail their schema or refused over a budget, non-``note`` calls on the
  closing turn) plus well-formed ``act`` calls whose command was not admissible (``remap`` decoding executes the
  closest admissible one instead; ``score`` decoding, which GRPO uses, never produces one). An admissible command
  the environment answers with "Nothing happens." is *not* invalid: the paper's ALFWorld adapter marks only
  inadmissible commands invalid, and such a command repeated is charged by ``S``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

from evoharness.config import CostConfig
from evoharness.harness.workspace import META_ACTIONS


@dataclass(frozen=True)
class Interaction:
    """What the budget reward reads from one episode (all counts are per episode, in calls).

    Parameters:
        won: ALFWorld's ``won`` flag.
        env_steps: environment actions executed.
        meta_calls: meta-action calls attempted (executed, invalid, refused or to an unknown tool; the closing
            turn's calls included).
        meta_actions: executed calls by meta-action type.
        repeats: ``S``, calls identical to the call before them.
        invalid: ``I``, rejected turns plus inadmissible acts.
    """

    won: bool
    env_steps: int
    meta_calls: int
    meta_actions: dict[str, int]
    repeats: int
    invalid: int

    def steps_used(self, cfg: CostConfig) -> int:
        """``|tau|``: the interaction budget this episode spent (meta-action calls only when they are charged)."""
        return self.env_steps + (self.meta_calls if cfg.charge_meta_actions else 0)


@dataclass(frozen=True)
class RewardParts:
    """One episode's reward, term by term, in reward units; ``total`` is the sum of the six signed terms.

    ``task``, ``efficiency``, ``diversity`` (``lambda_div * R_div``), ``spam`` and ``invalid`` (both <= 0) are the
    budget reward's terms; ``cost`` is ``-priced_cost`` when the priced cost is charged (``priced`` mode, or
    ``budget`` with ``charge_priced``) and 0 otherwise. ``priced_cost`` is ``EpisodeUsage.cost`` in both modes, so
    it is logged even when not charged. ``lambda_div`` is the diversity weight at this update (0 in ``priced``
    mode).
    """

    task: float
    efficiency: float
    diversity: float
    lambda_div: float
    spam: float
    invalid: float
    cost: float
    priced_cost: float
    total: float

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


def lambda_div(update: int | None, cfg: CostConfig) -> float:
    """The diversity weight after ``update`` policy updates (GRPO steps): cosine-annealed from ``lambda_div0`` at
    update 0 to 0 at ``anneal_updates`` and after, ``lambda_div0 * (1 + cos(pi * min(u, U) / U)) / 2``.
    ``update`` None (evaluation, no training step) is read as past the anneal: 0. Negative updates count as 0."""
    if update is None:
        return 0.0
    u = min(max(update, 0), cfg.anneal_updates)
    return cfg.lambda_div0 * (1.0 + math.cos(math.pi * u / cfg.anneal_updates)) / 2


def types_share(meta_actions: dict[str, int]) -> float:
    """``R_div``: the share of the four meta-action types with at least one executed call (0, .25, .5, .75, 1)."""
    return sum(meta_actions.get(m, 0) > 0 for m in META_ACTIONS) / len(META_ACTIONS)


def action_key(entry: dict) -> str:
    """The call a transcript entry records, as compared for repeats: an act's executed command, or the tool name
    and its arguments (keys sorted); lower-cased, runs of whitespace collapsed."""
    if entry.get("turn") == "act":
        text = str(entry.get("command", ""))
    else:
        text = f"{entry.get('turn')} {json.dumps(entry.get('args'), sort_keys=True, default=str)}"
    return " ".join(text.lower().split())


def count_repeats(actions: Sequence[str]) -> int:
    """``S``: how many calls equal the call right before them (a run of k identical calls counts k - 1)."""
    return sum(actions[i] == actions[i - 1] for i in range(1, len(actions)))


def episode_budgets(cfg: CostConfig, max_env_steps: int, max_meta_actions: int) -> tuple[int, int, int | None]:
    """The budgets a training episode plays under: (environment steps, executed meta-actions, shared interaction
    budget or None).

    ``priced``: the stage's own ``max_env_steps`` and ``max_meta_actions``, no shared budget. ``budget``: ``T_max``
    (``interaction_budget``) replaces both, and with ``charge_meta_actions`` every call spends one unit of it, so
    the episode ends once environment actions plus meta-action calls reach ``T_max``; without it, ``T_max``
    environment steps and ``max_meta_actions`` meta-actions, as the paper's free-meta-action setting."""
    if cfg.mode == "priced":
        return max_env_steps, max_meta_actions, None
    if cfg.charge_meta_actions:
        return cfg.interaction_budget, cfg.interaction_budget, cfg.interaction_budget
    return cfg.interaction_budget, max_meta_actions, None


def reward_parts(episode: Interaction, priced_cost: float, cfg: CostConfig, update: int | None = None) -> RewardParts:
    """The reward of one episode under ``cfg.mode``, every term separately.

    Args:
        episode: the episode's counts (``Interaction``).
        priced_cost: ``EpisodeUsage.cost(cfg)`` of the episode, in reward units.
        cfg: the cost configuration (mode and weights).
        update: policy updates so far (TRL's ``global_step`` when the rollout is played); None outside training.

    Returns:
        ``RewardParts``. In ``priced`` mode ``total`` is exactly ``float(won) - priced_cost``, today's reward.

    Raises:
        ValueError: an unknown ``cfg.mode`` (``CostConfig`` already rejects one when it is built).
    """
    if cfg.mode == "priced":
        return RewardParts(task=float(episode.won), efficiency=0.0, diversity=0.0, lambda_div=0.0, spam=0.0,
                           invalid=0.0, cost=-priced_cost, priced_cost=priced_cost,
                           total=float(episode.won) - priced_cost)
    if cfg.mode != "budget":
        raise ValueError(f"cost.mode is {cfg.mode!r}; use 'priced' or 'budget'")
    won = float(episode.won)
    t_max = cfg.interaction_budget
    weight = lambda_div(update, cfg)
    task = cfg.task_reward * won
    efficiency = cfg.lambda_eff * won * max(0.0, (t_max - episode.steps_used(cfg)) / t_max)
    diversity = weight * types_share(episode.meta_actions)
    spam = -cfg.lambda_spam * min(episode.repeats, cfg.spam_cap)
    invalid = -cfg.lambda_inv * episode.invalid
    cost = -priced_cost if cfg.charge_priced else 0.0
    return RewardParts(task=task, efficiency=efficiency, diversity=diversity, lambda_div=weight, spam=spam,
                       invalid=invalid, cost=cost, priced_cost=priced_cost,
                       total=task + efficiency + diversity + spam + invalid + cost)
