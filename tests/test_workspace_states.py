"""Exact workspace states for a hand-written observation sequence taken from a real ALFWorld game
(train/pick_heat_then_place_in_recep-Mug-None-Cabinet-22)."""

import json

from evoharness.config import TraceConfig
from evoharness.data.rawlog import Episode
from evoharness.harness.traces import Teacher
from evoharness.harness.workspace import Fact, Subgoal

GAME = "train/pick_heat_then_place_in_recep-Mug-None-Cabinet-22/trial_T20190908_072939_855818/game.tw-pddl"
STEPS = [
    (None, "-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. Looking quickly around you, you "
           "see a cabinet 4, a cabinet 1, a microwave 1.\n\nYour task is to: put a hot mug in cabinet."),
    ("go to cabinet 4", "You arrive at cabinet 4. The cabinet 4 is closed."),
    ("put mug 1 in cabinet 4", "Nothing happens."),
    ("open cabinet 4", "You open the cabinet 4. The cabinet 4 is open. In it, you see a mug 1."),
    ("take mug 1 from cabinet 4", "You pick up the mug 1 from the cabinet 4."),
    ("go to microwave 1", "You arrive at microwave 1. The microwave 1 is closed."),
    ("heat mug 1 with microwave 1", "You heat the mug 1 using the microwave 1."),
    ("go to cabinet 1", "You arrive at cabinet 1. The cabinet 1 is closed."),
    ("open cabinet 1", "You open the cabinet 1. The cabinet 1 is open. In it, you see nothing."),
    ("move mug 1 to cabinet 1", "You move the mug 1 to the cabinet 1."),
]


def episode() -> Episode:
    recs = []
    for step, (action, obs) in enumerate(STEPS):
        last = step == len(STEPS) - 1
        recs.append({"game": GAME, "task_type": "pick_heat_then_place_in_recep", "episode_id": "ep-heat",
                     "step": step, "observation": obs, "admissible_commands": ["look"], "action": action,
                     "action_source": None if step == 0 else "expert", "reward": float(last), "done": last,
                     "won": last, "perturbed": False})
    return Episode("ep-heat", GAME, "pick_heat_then_place_in_recep", recs)


def test_exact_belief_progress_and_experience_after_the_episode():
    teacher = Teacher(TraceConfig())

    row = teacher.annotate(episode())
    names = [(m["tool_calls"][0]["function"]["name"]) for m in row["messages"] if m["role"] == "assistant"]
    # open cabinet 4 shows the mug (track, commit find); take (track, commit take); heat (track, commit heat);
    # open cabinet 1 shows no mug (track searched); the last move wins, so no track follows it
    assert names == ["recall", "act", "act", "act", "track", "commit", "act", "track", "commit", "act", "act",
                     "track", "commit", "act", "act", "track", "act", "note"]
    assert row["meta_actions"] == {"track": 4, "commit": 3, "recall": 1, "note": 1}
    assert row["workspace"] == ("Progress: done find, take, heat\n"
                                "Belief: cabinet 1 searched=yes; mug 1 state=hot; mug 1 location=inventory")
    lessons = teacher.experience.all()
    assert [(x["text"], x["tags"], x["source_episode"]) for x in lessons] == [
        ("'put X in Y' does nothing: use 'move X to Y'", ["pick_heat_then_place_in_recep", "mug"], "ep-heat")]


def test_track_searched_off_leaves_out_only_the_searched_facts():
    """``traces.track_searched: false``: the same episode, the same calls but the ``searched`` track."""
    row = Teacher(TraceConfig(track_searched=False)).annotate(episode())
    names = [(m["tool_calls"][0]["function"]["name"]) for m in row["messages"] if m["role"] == "assistant"]
    assert names == ["recall", "act", "act", "act", "track", "commit", "act", "track", "commit", "act", "act",
                     "track", "commit", "act", "act", "act", "note"]
    assert row["meta_actions"] == {"track": 3, "commit": 3, "recall": 1, "note": 1}
    assert row["workspace"] == "Progress: done find, take, heat\nBelief: mug 1 state=hot; mug 1 location=inventory"


def test_workspace_objects_hold_sources_and_dependencies():
    from evoharness.harness.workspace import ExperienceStore, Workspace

    ws = Workspace(ExperienceStore(), "ep")
    ws.observe(3, STEPS[3][1])
    ws.call("track", {"entity": "mug 1", "attribute": "location", "value": "cabinet 4"}, 3)
    ws.call("commit", {"id": "find", "status": "done", "text": "find a mug"}, 3)
    ws.observe(4, STEPS[4][1])
    ws.call("track", {"entity": "mug 1", "attribute": "location", "value": "inventory"}, 4)
    ws.call("commit", {"id": "take", "status": "done", "text": "take a mug", "depends_on": ["find"]}, 4)
    assert ws.belief == {("mug 1", "location"): Fact("inventory", 4, STEPS[4][1])}
    assert ws.progress == {"find": Subgoal("find", "find a mug", "done", []),
                           "take": Subgoal("take", "take a mug", "done", ["find"])}


def _calls(row: dict) -> list[tuple[str, str]]:
    return [(m["tool_calls"][0]["function"]["name"], m["tool_calls"][0]["function"]["arguments"])
            for m in row["messages"] if m["role"] == "assistant"]


def test_call_dropout_of_every_track_and_commit_leaves_recall_acts_and_note():
    row = Teacher(TraceConfig(call_dropout={"track": 1.0, "commit": 1.0})).annotate(episode())
    assert [name for name, _ in _calls(row)] == ["recall"] + ["act"] * 9 + ["note"]
    assert row["meta_actions"] == {"track": 0, "commit": 0, "recall": 1, "note": 1}
    assert row["workspace"] == ""


def test_call_dropout_leaves_out_a_reproducible_subset_and_every_kept_commit_is_accepted():
    """Half the calls left out: a subset of the full teacher's calls in the same order, the same for the same episode
    id, other calls for another id; a commit whose predecessor was left out depends on the last one committed."""
    full = _calls(Teacher(TraceConfig()).annotate(episode()))
    cfg = TraceConfig(call_dropout={"track": 0.5, "commit": 0.5})
    kept_by_id = {}
    for ep_id in [f"ep-{i}" for i in range(12)]:
        ep = episode()
        ep.episode_id = ep_id
        row = Teacher(cfg).annotate(ep)
        calls = _calls(row)
        assert calls == _calls(Teacher(cfg).annotate(ep))
        it = iter(full)
        assert all(any(name == f[0] and (name == "commit" or args == f[1]) for f in it) for name, args in calls)
        assert [n for n, _ in calls if n not in ("track", "commit")] == ["recall"] + ["act"] * 9 + ["note"]
        committed = [json.loads(args)["id"] for name, args in calls if name == "commit"]
        deps = [json.loads(args)["depends_on"] for name, args in calls if name == "commit"]
        assert deps == ([[]] + [[c] for c in committed[:-1]] if committed else [])
        progress = row["workspace"].split("\n")[0] if committed else ""
        assert progress == (f"Progress: done {', '.join(committed)}" if committed else "")
        kept_by_id[ep_id] = calls
    assert len({json.dumps(c) for c in kept_by_id.values()}) > 1


def test_call_dropout_of_recall_or_note_or_out_of_range_is_refused():
    import pytest

    with pytest.raises(ValueError, match="'recall' and 'note' carry Experience"):
        TraceConfig(call_dropout={"recall": 0.5})
    with pytest.raises(ValueError, match="traces.call_dropout.track is 1.5"):
        TraceConfig(call_dropout={"track": 1.5})
