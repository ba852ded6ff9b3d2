"""The generic tool-using-agent log: validation, conversion to raw-log records, quarantine, and reading via DVC."""

import copy
import json

import pytest

from conftest import git
from evoharness.data.generic_log import FORMAT, parse_generic_lines, to_records, validate_generic
from evoharness.data.rawlog import RawLogError, read_episodes, validate_record

WON = {"format": FORMAT, "episode_id": "web-1", "task": "find the weather in Paris and report it",
       "initial_observation": "You are a web assistant.", "source": "my-agent",
       "steps": [{"tool": "search", "arguments": {"query": "weather Paris"}, "result": "Paris: 18C, cloudy"},
                 {"action": "answer 18C, cloudy", "result": "Answer recorded."}],
       "outcome": {"success": True}}
LOST = {"format": FORMAT, "episode_id": "house-2", "task": "put a clean mug in the coffeemachine",
        "initial_observation": "You are in the middle of a room.",
        "steps": [{"action": "go to countertop 1", "result": "On the countertop 1, you see a mug 1."},
                  {"action": "take mug 1 from countertop 1", "result": "You pick up the mug 1."},
                  {"tool": "calculator", "action": "2+2", "result": "4"}],
        "outcome": {"success": False, "reward": -0.5}}


def lines_of(*episodes):
    return [json.dumps(e) for e in episodes]


def test_two_episodes_convert_to_valid_raw_records():
    eps = parse_generic_lines(lines_of(WON, LOST) + [""], "a.generic.jsonl")
    assert [e.episode_id for e in eps] == ["web-1", "house-2"]
    for ep, src in zip(eps, (WON, LOST)):
        for rec in ep.records:
            validate_record(rec, "converted")
        assert [r["step"] for r in ep.records] == list(range(len(src["steps"]) + 1))
        assert ep.task == src["task"] and ep.game == f"generic/{src['episode_id']}" and ep.task_type == "generic"
        assert [r["done"] for r in ep.records] == [False] * len(src["steps"]) + [True]
        assert [r["observation"] for r in ep.records[1:]] == [s["result"] for s in src["steps"]]
        assert ep.records[0]["observation"].startswith(src["initial_observation"])
        assert all(r["admissible_commands"] == [] and not r["perturbed"] for r in ep.records)
    won, lost = eps
    assert won.won is True and won.records[-1]["reward"] == 1.0 and won.records[0]["reward"] == 0.0
    assert lost.won is False and lost.records[-1]["reward"] == -0.5
    assert [r["action"] for r in won.records] == [None, 'search({"query": "weather Paris"})', "answer 18C, cloudy"]
    assert [r["action"] for r in lost.records][1:] == ["go to countertop 1", "take mug 1 from countertop 1",
                                                      'calculator("2+2")']
    assert {r["action_source"] for r in won.records[1:]} == {"agent"}


def test_episode_without_steps_and_task_already_in_observation():
    ep = dict(WON, steps=[], initial_observation="Hi.\nYour task is to: " + WON["task"])
    (rec,) = to_records(ep)
    assert rec["observation"] == ep["initial_observation"] and rec["done"] and rec["won"] and rec["action"] is None
    assert parse_generic_lines(lines_of(ep), "x")[0].task == WON["task"]
    other = dict(ep, initial_observation="Your task is to: something else")
    with pytest.raises(RawLogError, match=r"x:1: field 'initial_observation' contains"):
        validate_generic(other, "x:1")


def mutated(path, value):
    ep = copy.deepcopy(LOST)
    *parents, last = path
    target = ep
    for key in parents:
        target = target[key]
    if value is KeyError:
        del target[last]
    else:
        target[last] = value
    return ep


@pytest.mark.parametrize("path, value, message", [
    (("task",), KeyError, r"field 'task' missing"),
    (("format",), KeyError, r"field 'format' missing"),
    (("format",), "other/v9", r"field 'format' is 'other/v9', expected 'evoharness.generic/v1'"),
    (("episode_id",), 7, r"field 'episode_id' is int, expected str"),
    (("steps",), {"a": 1}, r"field 'steps' is dict, expected list"),
    (("steps", 1, "result"), KeyError, r"field 'steps\[1\].result' missing"),
    (("steps", 0, "action"), None, r"field 'steps\[0\].action' is null, expected str"),
    (("steps", 2, "arguments"), [1], r"field 'steps\[2\].arguments' is list, expected object"),
    (("steps", 0, "args"), {}, r"field 'steps\[0\].args' is not part of the format"),
    (("outcome", "success"), 1, r"field 'outcome.success' is int, expected bool"),
    (("outcome", "success"), KeyError, r"field 'outcome.success' missing"),
    (("outcome", "reward"), True, r"field 'outcome.reward' is bool, expected number"),
    (("outcome", "reward"), float("nan"), r"field 'outcome.reward' is nan, expected a finite number"),
    (("extra",), 1, r"field 'extra' is not part of the format; remove it or move it into 'metadata'"),
])
def test_bad_episode_names_file_line_and_field(path, value, message):
    lines = lines_of(WON, mutated(path, value))
    with pytest.raises(RawLogError, match=r"^logs/s\.generic\.jsonl:2: " + message) as err:
        parse_generic_lines(lines, "logs/s.generic.jsonl")
    assert "docs/generic-log-format.md" in str(err.value)


def test_undecodable_and_non_object_lines_are_reported():
    with pytest.raises(RawLogError, match=r"x.generic.jsonl:2: not valid JSON"):
        parse_generic_lines(["", "{oops"], "x.generic.jsonl")
    with pytest.raises(RawLogError, match=r"x.generic.jsonl:1: record is list, expected a JSON object"):
        parse_generic_lines(["[1]"], "x.generic.jsonl")


def test_quarantine_keeps_good_episodes_and_reports_bad_ones():
    bad = mutated(("outcome", "success"), "yes")
    dup_a, dup_b = dict(LOST, episode_id="dup"), dict(WON, episode_id="dup")
    lines = lines_of(WON, bad) + ["{oops"] + lines_of(dup_a, dup_b)
    quarantine = []
    eps = parse_generic_lines(lines, "q.generic.jsonl", quarantine)
    assert [e.episode_id for e in eps] == ["web-1"]
    assert sorted(q["where"] for q in quarantine) == [f"q.generic.jsonl:{i}" for i in (2, 3, 4, 5)]
    by_where = {q["where"]: q for q in quarantine}
    assert "field 'outcome.success' is str, expected bool" in by_where["q.generic.jsonl:2"]["error"]
    assert by_where["q.generic.jsonl:2"]["line"] == lines[1]
    assert "not valid JSON" in by_where["q.generic.jsonl:3"]["error"]
    assert "already used at q.generic.jsonl:4" in by_where["q.generic.jsonl:5"]["error"]
    assert "used again at q.generic.jsonl:5" in by_where["q.generic.jsonl:4"]["error"]
    with pytest.raises(RawLogError, match=r"q.generic.jsonl:2: field 'outcome.success'"):
        parse_generic_lines(lines, "q.generic.jsonl")


def test_read_episodes_reads_generic_shards_through_dvc(git_repo):
    """A real git+DVC repo with a generic shard next to a raw-log shard: both are read at a committed rev."""
    from evoharness.data.datastore import dvc_add, ensure_dvc_repo

    ensure_dvc_repo(git_repo)
    logs = git_repo / "data" / "logs"
    logs.mkdir(parents=True)
    (logs / "shard-00000.generic.jsonl").write_text("\n".join(lines_of(WON, LOST)) + "\n")
    raw = to_records(dict(LOST, episode_id="raw-3"))
    (logs / "shard-00001.jsonl").write_text("".join(json.dumps(r) + "\n" for r in raw))
    md5 = dvc_add(git_repo)
    git(git_repo, "add", "-A")
    git(git_repo, "commit", "-qm", "generic data")
    for rev in ("HEAD", None):
        eps, m = read_episodes(git_repo, rev)
        assert m == md5
        assert [(e.episode_id, e.won, e.task, len(e.records)) for e in eps] == [
            ("web-1", True, WON["task"], 3), ("house-2", False, LOST["task"], 4), ("raw-3", False, LOST["task"], 4)]
    (logs / "shard-00000.generic.jsonl").write_text(json.dumps(mutated(("steps", 0, "result"), KeyError)) + "\n")
    with pytest.raises(RawLogError, match=r"data/logs/shard-00000.generic.jsonl:1: field 'steps\[0\].result'"):
        read_episodes(git_repo)
