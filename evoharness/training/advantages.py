"""Per-turn advantages for GRPO on multi-turn episodes: episode-level group advantages (GRPO) and GiGPO's
step-level anchor-state groups added to them.

GRPO (Shao et al. 2024, arXiv:2402.03300) gives every turn of an episode the episode's advantage: its reward less
the group's mean, over the group's standard deviation, the group being the episodes of one game in one step.
GiGPO (Feng et al. 2025, "Group-in-Group Policy Optimization for LLM Agent Training", arXiv:2505.10978) adds a
step-level advantage: the turns of a group's episodes that start from the same environment state (an *anchor
state*: here the same latest observation text, which every episode of a game shares on its first turn and
wherever two episodes reach the same place) form a step group; each turn's discounted return ``gamma^k R`` (``k``
turns after it to the episode's end, ``R`` the episode's reward) is normalised within its step group, and the
turn's advantage is ``A_episode + omega * A_step``. A turn whose state no other turn shares has step advantage 0.

Standard deviations are the unbiased ones (TRL's group normalisation uses the same); a group whose members are equal
gets 0 for all of them.
"""

from __future__ import annotations

import math
from collections import defaultdict

ADVANTAGES = ("grpo", "gigpo")


def _normalised(values: list[float], eps: float = 1e-6) -> list[float]:
    """``(v - mean) / (std + eps)`` with the unbiased std; all 0 for fewer than two values or no spread."""
    n = len(values)
    if n < 2:
        return [0.0] * n
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    if std < 1e-12:
        return [0.0] * n
    return [(v - mean) / (std + eps) for v in values]


def episode_advantages(rewards: list[float]) -> list[float]:
    """GRPO's group-relative advantage of each episode of one group: ``(R_i - mean R) / (std R + 1e-6)``.

    ``rewards``: one float per episode (reward units). Returns a list of the same length; all zeros when the group
    has one episode or every episode got the same reward (no signal to learn from)."""
    return _normalised(list(rewards))


def discounted_returns(n_turns: int, reward: float, gamma: float) -> list[float]:
    """The return of each of an episode's ``n_turns`` turns when its only reward ``reward`` comes after its last
    turn: turn t gets ``gamma ** (n_turns - 1 - t) * reward`` (GiGPO's discounted step return for a sparse reward).
    Raises ValueError for ``gamma`` outside (0, 1]."""
    if not 0 < gamma <= 1:
        raise ValueError(f"grpo.gigpo_gamma is {gamma}: use a value in (0, 1]")
    return [gamma ** (n_turns - 1 - t) * reward for t in range(n_turns)]


def turn_advantages(anchors: list[list[str | None]], rewards: list[float], mode: str = "grpo",
                    gamma: float = 0.95, omega: float = 1.0) -> list[list[float]]:
    """The advantage of every turn of one group's episodes.

    Parameters:
        anchors: per episode, one anchor-state key per turn in play order (the latest environment observation the
            turn's prompt showed); None marks a turn that joins no step group.
        rewards: per episode, its reward (same length as ``anchors``).
        mode: ``grpo``: every turn gets its episode's ``episode_advantages``; ``gigpo``: plus ``omega`` times the
            turn's step-level advantage (the module docstring).
        gamma / omega: GiGPO's discount of step returns and weight of the step-level term (the paper: 0.95, 1).

    Returns per episode a list of per-turn advantages, shaped as ``anchors``. Raises ValueError for an unknown
    ``mode`` or mismatched lengths.
    """
    if mode not in ADVANTAGES:
        raise ValueError(f"grpo.advantage is {mode!r}: use one of {', '.join(ADVANTAGES)}")
    if len(anchors) != len(rewards):
        raise ValueError(f"{len(anchors)} episodes of anchors but {len(rewards)} rewards")
    per_episode = episode_advantages(rewards)
    out = [[a] * len(turns) for a, turns in zip(per_episode, anchors)]
    if mode == "grpo":
        return out
    groups: dict[str, list[tuple[int, int, float]]] = defaultdict(list)
    for e, (turns, reward) in enumerate(zip(anchors, rewards)):
        for t, (key, ret) in enumerate(zip(turns, discounted_returns(len(turns), reward, gamma))):
            if key is not None:
                groups[key].append((e, t, ret))
    for members in groups.values():
        for (e, t, _), a in zip(members, _normalised([ret for _, _, ret in members])):
            out[e][t] += omega * a
    return out
