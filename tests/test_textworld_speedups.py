"""TextWorld speed-ups (``evoharness.env.textworld_speedups``): real games play the same with and without them."""

from __future__ import annotations

import dataclasses

import pytest

from evoharness.config import CollectConfig
from evoharness.data.collect import play_expert_episode
from evoharness.env import textworld_speedups as speedups
from evoharness.env.alfworld import TASK_TYPES, games_root, list_games, task_type_of


@pytest.fixture
def shipped_then_restored():
    """TextWorld as shipped for the test body (yields a MonkeyPatch undone before the teardown); afterwards the
    speed-ups as they were before the test (other tests, and a run with them off, rely on that)."""
    was_installed = speedups.installed()
    speedups.uninstall()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(speedups.ENV_VAR, "0")
        yield mp
    speedups.uninstall()
    if was_installed:
        speedups.install()


def _one_game_per_type(types: tuple[str, ...]) -> list[str]:
    picked: dict[str, str] = {}
    for game in list_games("train", stride=37):
        picked.setdefault(TASK_TYPES[task_type_of(game)], game)
    return [picked[t] for t in types]


def test_expert_episodes_identical_with_and_without_speedups(shipped_then_restored):
    """Every record of real expert episodes (observations, admissible commands, actions, reward, won), with random
    and invalid commands mixed in, is the same as shipped; and the speed-ups really ran (counters moved)."""
    games = _one_game_per_type(("Look", "Clean", "Pick Two"))
    # no wall-clock limit: on a machine shared with other work an episode cut by the stall timer is not a difference
    cfg = dataclasses.replace(CollectConfig(), perturb_share=1.0, max_steps=30, episode_timeout_s=0)
    assert speedups.install() is False  # disabled by the environment variable
    shipped = [play_expert_episode(g, cfg) for g in games]
    assert not speedups.installed()

    shipped_then_restored.setenv(speedups.ENV_VAR, "1")
    before = speedups.stats()
    assert speedups.install() is True
    patched = [play_expert_episode(g, cfg) for g in games]
    after = speedups.stats()

    ends = [(e[-1].get("error"), e[-1]["won"]) for e in shipped + patched]
    assert [len(e) for e in patched] == [len(e) for e in shipped], f"episode ends (error, won): {ends}"
    assert sum(len(e) for e in shipped) > 30
    assert any(r["action_source"] == "invalid" for e in shipped for r in e)
    for ep_shipped, ep_patched in zip(shipped, patched):
        assert ep_patched == ep_shipped
    assert after["state_reused"] - before["state_reused"] == len(games)
    assert after["parse_hits"] - before["parse_hits"] > after["parse_misses"] - before["parse_misses"] > 0
    # the expert never re-plans: every optimized translation was deferred and none was made
    assert after["replan_translations_deferred"] - before["replan_translations_deferred"] >= len(games)
    assert after["replan_translations_done"] == before["replan_translations_done"]


def _policy_commands_over_a_walk(game: str) -> list[list[str]]:
    """TextWorld's own planner (``policy_commands``: a ``replan`` at every step) along the first four ``go to``s."""
    import textworld
    from textworld.envs.pddl import PddlEnv

    env = PddlEnv(textworld.EnvInfos(admissible_commands=True, policy_commands=True))
    env.load(str(games_root() / game))
    state = env.reset()
    plans = [state["policy_commands"]]
    for _ in range(4):
        state, _, _ = env.step(next(c for c in state["admissible_commands"] if c.startswith("go to ")))
        plans.append(state["policy_commands"])
    return plans


def test_a_replan_plans_as_shipped(shipped_then_restored):
    """Where TextWorld re-plans (``policy_commands``), the deferred optimized translation is made then, and every
    plan along the walk is the shipped one."""
    (game,) = _one_game_per_type(("Heat",))
    shipped = _policy_commands_over_a_walk(game)
    assert all(plan for plan in shipped)
    shipped_then_restored.setenv(speedups.ENV_VAR, "1")
    assert speedups.install()
    before = speedups.stats()
    patched = _policy_commands_over_a_walk(game)
    after = speedups.stats()
    assert patched == shipped
    assert after["replan_translations_done"] - before["replan_translations_done"] >= 1


def test_second_reset_starts_the_game_again(shipped_then_restored):
    """Only the first ``reset`` after ``load`` reuses its state: a later ``reset`` of the same game without a new
    ``load`` (TextWorld's gym environment always loads first, a direct ``PddlEnv`` user need not) starts from the
    initial state again, not from the state the episode left."""
    import textworld
    from textworld.envs.pddl import PddlEnv

    shipped_then_restored.setenv(speedups.ENV_VAR, "1")
    assert speedups.install()
    (game,) = _one_game_per_type(("Pick",))
    env = PddlEnv(textworld.EnvInfos(admissible_commands=True))
    env.load(str(games_root() / game))
    first = env.reset()
    start = (first.feedback, first["admissible_commands"])
    state = first
    for _ in range(3):
        state, _, _ = env.step(next(c for c in state["admissible_commands"] if c.startswith("go to ")))
    assert state["admissible_commands"] != start[1]  # the episode moved
    again = env.reset()
    assert (again.feedback, again["admissible_commands"]) == start
    assert speedups.stats()["state_reused"] >= 1


def test_other_textworld_versions_are_left_as_shipped(shipped_then_restored):
    import textworld

    shipped_then_restored.setenv(speedups.ENV_VAR, "1")
    shipped_then_restored.setattr(textworld, "__version__", "1.7.1")
    assert speedups.install() is False
    assert not speedups.installed()

