import pytest

from evoharness.agent import ExpertPolicy, run_episode
from evoharness.alfworld_env import ALFWorldEnv, list_games, task_params_from_path, task_type_of
from evoharness.config import CostConfig
from evoharness.harness import ExperienceStore, Workspace


def test_list_games_counts_and_unknown_split():
    assert len(list_games("valid_seen")) == 140
    assert len(list_games("train", limit=5, offset=10, stride=3)) == 5
    with pytest.raises(FileNotFoundError, match="valid_unseen.*present"):
        list_games("valid_unseen")


def test_task_params_from_folder_name():
    look = "valid_seen/look_at_obj_in_light-AlarmClock-None-DeskLamp-301/trial_T1/game.tw-pddl"
    assert task_params_from_path(look) == {
        "task_type": "look_at_obj_in_light", "object_target": "AlarmClock", "mrecep_target": "",
        "parent_target": "", "toggle_target": "DeskLamp", "object_sliced": False}
    pick = "train/pick_and_place_simple-Apple-Bowl-Fridge-5/trial_T1/game.tw-pddl"
    p = task_params_from_path(pick)
    assert (p["parent_target"], p["mrecep_target"], p["toggle_target"]) == ("Fridge", "Bowl", "")
    assert task_type_of(pick) == "pick_and_place_simple"
    with pytest.raises(ValueError, match="not <task>"):
        task_params_from_path("train/weird/trial/game.tw-pddl")


def test_missing_game_file_names_the_path():
    with pytest.raises(FileNotFoundError, match="no_such_game"):
        ALFWorldEnv("train/no_such_game/trial/game.tw-pddl")


def test_expert_wins_real_games_and_won_is_not_done():
    games = list_games("valid_seen", limit=2)
    wins = []
    for game in games:
        env = ALFWorldEnv(game, max_steps=60)
        res = run_episode(env, ExpertPolicy(), Workspace(ExperienceStore()), CostConfig(), max_env_steps=60)
        env.close()
        wins.append(res.won)
        assert res.env_steps > 0 and res.meta_actions == {"track": 0, "commit": 0, "recall": 0, "note": 0}
    assert all(wins)
    # out of steps: done but not won
    env = ALFWorldEnv(games[0], max_steps=2)
    env.reset()
    env.step("look")
    last = env.step("look")
    env.close()
    assert last.done and not last.won
