"""scripts/failure_modes.py: why lost evaluation episodes were lost, from their transcripts."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import failure_modes  # noqa: E402

GAME = "valid_seen/pick_and_place_simple-Candle-None-Cart-401/trial_T20190908_0/game.tw-pddl"


def act(command, result="You arrive somewhere."):
    return {"turn": "act", "args": {"command": command}, "result": result}


def meta(ok=True):
    return {"turn": "track", "args": {"entity": "toilet 1", "attribute": "searched", "value": "yes"}, "ok": ok}


def test_task_object_from_alfworld_game_paths():
    assert failure_modes.task_object(GAME) == "candle"
    assert failure_modes.task_object("valid_seen/look_at_obj_in_light-AlarmClock-None-DeskLamp-323/t/g") \
        == "alarmclock"
    assert failure_modes.task_object("my_games/kitchen-3/game.json") is None


def test_lost_episodes_are_classified(tmp_path):
    # saw "candle 1" on the toilet, left, then looped between two places until the 12-step budget ran out
    looped = [act("go to toilet 1", "On the toilet 1, you see a candle 1, and a spraybottle 1."), meta(),
              act("go to garbagecan 1")] + [act(f"go to {'toilet' if i % 2 else 'garbagecan'} 1") for i in range(10)]
    looped += [meta(ok=False)]
    # never saw a candle ("candlestick 1" is another object), did not loop, stopped before the budget
    searched = [act(f"go to drawer {i}", "On the drawer, you see a candlestick 1.") for i in range(1, 6)]
    won = [act("go to toilet 1", "you see a candle 1"), act("take candle 1 from toilet 1")]
    episodes = [{"game": GAME, "won": False, "transcript": looped},
                {"game": GAME, "won": False, "transcript": searched},
                {"game": GAME, "won": True, "transcript": won},
                {"game": GAME, "won": False, "transcript": [], "error": "reset failed: OSError(28, 'No space')"}]
    f = failure_modes.episode_failure(episodes[0], max_env_steps=12)
    assert f == {"budget": True, "loop": True, "seen_not_taken": True, "never_seen": False, "object_unknown": False,
                 "revisits": 6, "meta_actions": 1, "rejected": 1}
    g = failure_modes.episode_failure(episodes[1], max_env_steps=12)
    assert (g["budget"], g["loop"], g["seen_not_taken"], g["never_seen"], g["revisits"]) == (False, False, False,
                                                                                             True, 1)
    rows = dict(failure_modes.failure_table(episodes, max_env_steps=12))
    assert rows["lost"] == "2" and rows["won"] == "1" and rows["environment failed (not classified)"] == "1"
    assert rows["lost: task object seen, never taken"] == "1 (50 %)"
    assert rows["lost: task object never seen"] == "1 (50 %)"
    assert rows["lost: mean meta-actions executed per episode"] == "0.5"

    path = tmp_path / "transcripts.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in episodes) + "\n")
    assert failure_modes.main([str(path), "--max-env-steps", "12", "--out", str(tmp_path / "f.md")]) == 0
    assert "| lost: used all 12 environment steps | 1 (50 %) |" in (tmp_path / "f.md").read_text()
    path.write_text("{not json\n")
    assert failure_modes.main([str(path)]) == 2
