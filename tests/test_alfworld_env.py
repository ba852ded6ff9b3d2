import pytest

from evoharness.config import CostConfig
from evoharness.env.alfworld import ALFWorldEnv, list_games, task_params_from_path, task_type_of
from evoharness.harness.workspace import ExperienceStore, Workspace
from evoharness.policy.agent import ExpertPolicy, run_episode


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


def test_expert_tracks_move_commands_and_wins_pick_two():
    """ALFWorld 0.4.2's handcoded expert tracks its inventory on ``put``, but ALFWorld 0.4 plays ``move``. Before
    ``env.alfworld._tracking_moves`` its 9th command here moved alarmclock 1, already on the desk, again
    (inadmissible, so ``look``); it wandered and won at step 26 (measured). In ``data-full``'s episode of this game
    (another seed) it never won."""
    game = "train/pick_two_obj_and_place-AlarmClock-None-Desk-307/trial_T20190907_013652_494441/game.tw-pddl"
    env = ALFWorldEnv(game, max_steps=50)
    res, commands = env.reset(0), []
    while not res.done:
        commands.append(res.expert_action)
        res = env.step(commands[-1])
    env.close()
    assert res.won and len(commands) == 9
    moves = [c for c in commands if c.startswith("move ")]
    assert len(moves) == 2 and moves[0] != moves[1] and commands[8] == moves[1]
