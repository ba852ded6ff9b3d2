"""Per-turn advantages (evoharness.training.advantages) and the group rows TRL receives when every turn is trained
(evoharness.training.rollouts.advantage_samples): each value against a hand computation."""

import math
from types import SimpleNamespace

import pytest

from evoharness.config import GRPOStageConfig
from evoharness.training.advantages import discounted_returns, episode_advantages, turn_advantages
from evoharness.training.rollouts import advantage_samples

R2 = math.sqrt(2)


def test_episode_advantages_are_group_relative_with_the_unbiased_std():
    # mean 0.5, unbiased std sqrt(1/3): (1 - 0.5) / 0.57735 = 0.866025
    assert episode_advantages([1, 0, 0, 1]) == pytest.approx([0.866025, -0.866025, -0.866025, 0.866025], abs=1e-5)
    assert episode_advantages([3.0, 3.0, 3.0]) == [0.0, 0.0, 0.0]  # no spread, no signal
    assert episode_advantages([5.0]) == [0.0]


def test_discounted_returns_of_a_terminal_reward():
    assert discounted_returns(3, 10.0, 0.5) == [2.5, 5.0, 10.0]
    assert discounted_returns(0, 1.0, 0.95) == []
    with pytest.raises(ValueError, match="gigpo_gamma is 0"):
        discounted_returns(2, 1.0, 0.0)


def test_grpo_gives_every_turn_its_episodes_advantage():
    adv = turn_advantages([["a", "b"], ["a", "c", "b"]], [1.0, 0.0], "grpo")
    # two episodes: mean 0.5, unbiased std sqrt(0.5): +-0.5 / 0.7071 = +-0.7071
    assert adv == [pytest.approx([1 / R2] * 2, abs=1e-5), pytest.approx([-1 / R2] * 3, abs=1e-5)]


def test_gigpo_adds_the_step_advantage_of_turns_that_share_a_state():
    """Episode 0 (won, reward 1): states a, b. Episode 1 (lost, 0): a, c, b. gamma 0.5: episode 0's returns are
    0.5, 1; episode 1's are all 0. Step group a: {0.5, 0} -> +-0.7071; b: {1, 0} -> +-0.7071; c alone -> 0."""
    adv = turn_advantages([["a", "b"], ["a", "c", "b"]], [1.0, 0.0], "gigpo", gamma=0.5, omega=1.0)
    assert adv[0] == pytest.approx([R2, R2], abs=1e-5)
    assert adv[1] == pytest.approx([-R2, -1 / R2, -R2], abs=1e-5)
    half = turn_advantages([["a", "b"], ["a", "c", "b"]], [1.0, 0.0], "gigpo", gamma=0.5, omega=0.5)
    assert half[1] == pytest.approx([-1 / R2 - 0.5 / R2, -1 / R2, -1 / R2 - 0.5 / R2], abs=1e-5)


def test_gigpo_step_groups_use_discounted_returns_and_skip_turns_without_a_state():
    # both episodes won (episode advantages 0); s is 1 turn from the end in one, 2 in the other: returns 0.9, 0.81
    adv = turn_advantages([["s", None], ["x", "s", "y", "z"]], [1.0, 1.0], "gigpo", gamma=0.9)
    spread = 1 / R2  # two distinct values normalise to +-1/sqrt(2); the higher return (0.9) is +
    assert adv[0] == pytest.approx([spread, 0.0], abs=1e-4)  # eps 1e-6 against a std of 0.064
    assert adv[1] == pytest.approx([0.0, -spread, 0.0, 0.0], abs=1e-4)
    with pytest.raises(ValueError, match="advantage is 'ppo'"):
        turn_advantages([["s"]], [1.0], "ppo")


def _turn(anchor, tag):
    return {"prompt_ids": [tag], "completion_ids": [tag], "logprobs": [0.0], "env_mask": [1], "anchor": anchor}


def _trl_advantages(values):
    """TRL's GRPOTrainer with scale_rewards="none": the reward less the group's mean
    (trl/trainer/grpo_trainer.py, `_generate_and_score_completions`)."""
    mean = sum(values) / len(values)
    return [v - mean for v in values]


def test_advantage_samples_hand_trl_the_turn_advantages_unchanged():
    cfg = GRPOStageConfig(num_generations=2, turns_per_group=8, advantage="gigpo", gigpo_gamma=0.5)
    pad = {"prompt_ids": [0], "completion_ids": [0], "logprobs": [0.0], "env_mask": [0]}
    episodes = [(SimpleNamespace(reward=1.0), [_turn("a", 1), _turn("b", 2)]),
                (SimpleNamespace(reward=0.0), [_turn("a", 3), _turn("c", 4), _turn("b", 5)])]
    samples, values, dropped = advantage_samples(episodes, cfg, pad, seed=0)
    assert dropped == 0 and len(samples) == len(values) == 8
    assert [s["prompt_ids"][0] for s in samples] == [1, 2, 3, 4, 5, 0, 0, 0]
    expected = [R2, R2, -R2, -1 / R2, -R2]
    assert values[:5] == pytest.approx(expected, abs=1e-5)
    assert values[5] == pytest.approx(-sum(expected), abs=1e-5) and values[6:] == [0.0, 0.0]
    assert _trl_advantages(values)[:5] == pytest.approx(expected, abs=1e-5)


def test_advantage_samples_draw_turns_when_the_group_is_full():
    cfg = GRPOStageConfig(num_generations=2, turns_per_group=4)
    pad = {"prompt_ids": [0], "completion_ids": [0], "logprobs": [0.0], "env_mask": [0]}
    episodes = [(SimpleNamespace(reward=1.0), [_turn("a", 1), _turn("b", 2), _turn("c", 3)]),
                (SimpleNamespace(reward=0.0), [_turn("a", 4), _turn("d", 5)])]
    samples, values, dropped = advantage_samples(episodes, cfg, pad, seed=3)
    assert dropped == 2 and len(samples) == 4 and samples[-1] is pad
    kept = [s["prompt_ids"][0] for s in samples[:3]]
    assert kept == sorted(kept) and len(set(kept)) == 3  # play order kept, no turn twice
    by_tag = {1: 1 / R2, 2: 1 / R2, 3: 1 / R2, 4: -1 / R2, 5: -1 / R2}
    assert values[:3] == pytest.approx([by_tag[k] for k in kept], abs=1e-5)
    assert sum(values) == pytest.approx(0.0, abs=1e-9)
    assert advantage_samples(episodes, cfg, pad, seed=3)[0] == samples  # the draw is the seed's


def test_every_turn_settings_are_checked():
    with pytest.raises(ValueError, match="gigpo needs grpo.turns_per_group"):
        GRPOStageConfig(advantage="gigpo")
    with pytest.raises(ValueError, match="turns_per_group is 1"):
        GRPOStageConfig(turns_per_group=1)
    with pytest.raises(ValueError, match="advantage is 'ppo'"):
        GRPOStageConfig(advantage="ppo", turns_per_group=8)
