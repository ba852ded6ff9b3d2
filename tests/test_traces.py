import json

from evoharness.config import TraceConfig
from evoharness.data.rawlog import parse_lines
from evoharness.env.alfworld import task_params_from_path
from evoharness.harness.traces import Teacher, build_traces, subgoal_plan
from evoharness.harness.workspace import ExperienceStore


def episodes(tiny_logs):
    out, _ = tiny_logs
    return parse_lines((out / "logs" / "shard-00000.jsonl").read_text().splitlines(), "shard")


def calls(row, name):
    return [json.loads(m["tool_calls"][0]["function"]["arguments"]) for m in row["messages"]
            if m["role"] == "assistant" and m["tool_calls"][0]["function"]["name"] == name]


def test_teacher_places_meta_actions_where_they_pay(tiny_logs):
    eps = sorted(episodes(tiny_logs), key=lambda e: e.episode_id)
    teacher = Teacher(TraceConfig())
    rows = [teacher.annotate(ep) for ep in eps]
    first = rows[0]
    names = [m["tool_calls"][0]["function"]["name"] for m in first["messages"] if m["role"] == "assistant"]
    # recall at start (query: the task object; the task itself is in every prompt, so no goal commit), note at end
    assert names[:2] == ["recall", "act"] and names[-1] == "note"
    assert calls(first, "recall")[0] == {"query": task_params_from_path(eps[0].game)["object_target"].lower()}
    assert first["messages"][3]["content"] == "no lessons yet"  # nothing earlier to recall: no leakage
    assert "[" in rows[1]["messages"][3]["content"]  # the second episode recalls the first one's lesson
    assert len(calls(first, "act")) == len(eps[0].records) - 1
    for row, ep in zip(rows, eps):
        if ep.won:
            done = [c["id"] for c in calls(row, "commit") if c["status"] == "done"]
            # every subgoal but the last is committed; the last one completes with the win, which ends the episode
            assert done == [g[0] for g in subgoal_plan(ep.game)][:-1]
            assert any(c["value"] == "inventory" for c in calls(row, "track"))


def test_trace_hash_is_deterministic_and_content_sensitive(tmp_path, tiny_logs):
    eps = episodes(tiny_logs)
    a = build_traces(eps, TraceConfig(), tmp_path / "a")
    b = build_traces(list(reversed(eps)), TraceConfig(), tmp_path / "b")
    assert a["content_hash"] == b["content_hash"]
    assert (tmp_path / "a/train.jsonl").read_bytes() == (tmp_path / "b/train.jsonl").read_bytes()
    c = build_traces(eps[:2], TraceConfig(), tmp_path / "c")
    assert c["content_hash"] != a["content_hash"]
    assert a["kept"] == sum(e.won for e in eps) == a["train_rows"] + a["valid_rows"]
    row = json.loads((tmp_path / "a/train.jsonl").read_text().splitlines()[0])
    assert isinstance(row["messages"][2]["tool_calls"][0]["function"]["arguments"], str)
    assert {t["function"]["name"] for t in json.loads(row["tools"])} == {"act", "track", "commit", "recall", "note"}


def test_experience_store_is_written(tmp_path, tiny_logs):
    eps = episodes(tiny_logs)
    stats = build_traces(eps, TraceConfig(), tmp_path / "t", experience_path=tmp_path / "exp.db")
    assert stats["lessons"] == len(ExperienceStore(tmp_path / "exp.db").all()) >= 1
