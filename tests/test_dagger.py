"""DAgger: a policy plays real ALFWorld games, the handcoded expert labels each state; traces train on the labels."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from conftest import git
from evoharness.config import CostConfig, EvalConfig, TraceConfig
from evoharness.data import datastore
from evoharness.data.dagger import collect_dagger
from evoharness.data.rawlog import dagger_policy, parse_lines
from evoharness.harness.traces import build_traces

EVAL = EvalConfig(split="train", limit=0, max_env_steps=12, max_meta_actions=2, decoding="remap")
TURN = TraceConfig(context="turn", won_only=True)


class Stop(Exception):
    pass


@pytest.fixture(scope="module")
def dagger_logs(tmp_path_factory, tiny_games):
    """The random policy's episodes of the three tiny games, labelled by the expert; the collection is killed after
    its first episode and run again, which resumes."""
    out = tmp_path_factory.mktemp("dagger") / "data-dagger-t"
    seen = []

    def stop_after_one(line):
        seen.append(line)
        if "episodes/min" in line:
            raise Stop(line)

    with pytest.raises(Stop):
        collect_dagger("random", tiny_games, out, EVAL, CostConfig(), "t", workers=1, progress=stop_after_one)
    assert len(list((out / "dagger-t.partial").glob("*.json.done"))) == 1
    manifest = collect_dagger("random", tiny_games, out, EVAL, CostConfig(), "t", workers=2, progress=seen.append)
    return out, manifest, seen


def _episodes(out):
    lines = [line for f in sorted((out / "logs").glob("*.jsonl")) for line in f.read_text().splitlines()]
    return parse_lines(lines, str(out))


def test_policy_episodes_carry_the_experts_label_for_each_state_and_resume(dagger_logs, tiny_games):
    out, manifest, seen = dagger_logs
    assert manifest["resumed"] == 1 and any("resuming" in line for line in seen)
    assert not (out / "dagger-t.partial").exists() and json.loads((out / "dagger-t.json").read_text())["episodes"] == 3
    episodes = _episodes(out)  # the raw-log schema's validation passes
    assert sorted(e.game for e in episodes) == sorted(tiny_games)
    assert all(e.episode_id.startswith("dagger-t/") for e in episodes)
    steps = [r for e in episodes for r in e.records[1:]]
    assert all(r["action_source"] == "policy" for r in steps)
    assert all(len(e.records) - 1 <= EVAL.max_env_steps and e.records[-1]["done"] for e in episodes)
    # a random policy mostly strays from the expert; the expert's label is its command for the state it was in
    labelled = [r for r in steps if r["expert_action"]]
    assert len(labelled) >= len(steps) - 3
    agree = sum(r["action"] == r["expert_action"] for r in labelled) / len(labelled)
    assert manifest["agreement"] == pytest.approx(agree) and agree < 0.5
    assert manifest["labelled_steps"] == len(labelled) and manifest["steps"] == len(steps)


def test_the_expert_as_policy_agrees_with_its_own_labels(tmp_path, tiny_games):
    manifest = collect_dagger("expert", tiny_games[:1], tmp_path / "d", EVAL, CostConfig(), "e", workers=1,
                              progress=None)
    assert manifest["labelled_steps"] > 0 and manifest["agreement"] == 1.0
    again = collect_dagger("expert", tiny_games[:1], tmp_path / "d", EVAL, CostConfig(), "e", workers=1,
                           progress=None)  # finished: returned as it is, nothing played
    assert again["resumed"] == 1 and again["wall_s"] == 0.0 and again["steps"] == manifest["steps"]


def test_a_killed_collection_resumed_with_other_games_is_refused(tmp_path, tiny_games):
    def stop(line):
        raise Stop(line)

    with pytest.raises(Stop):
        collect_dagger("random", tiny_games[:2], tmp_path / "d", EVAL, CostConfig(), "r", workers=1, progress=stop)
    with pytest.raises(ValueError, match="use another tag"):
        collect_dagger("random", tiny_games[1:], tmp_path / "d", EVAL, CostConfig(), "r", workers=1, progress=None)


def test_traces_target_the_expert_labels_and_keep_lost_dagger_episodes(dagger_logs, tiny_logs, tmp_path):
    out, _, _ = dagger_logs
    episodes = _episodes(out)
    assert not any(e.won for e in episodes)  # random play: every episode lost, yet kept (targets are the expert's)
    stats = build_traces(episodes, TURN, tmp_path / "turn")
    assert stats["dagger_episodes"] == 3 and stats["kept"] == 3
    rows = [json.loads(line) for split in ("train", "valid")
            for line in (tmp_path / "turn" / f"{split}.jsonl").read_text().splitlines()]
    targets = {}
    for row in rows:
        call = row["completion"][0]["tool_calls"][0]["function"]
        if call["name"] == "act":
            targets.setdefault(row["episode_id"], []).append(json.loads(call["arguments"])["command"])
    for ep in episodes:
        want = [r["expert_action"] for prev, r in zip(ep.records, ep.records[1:])
                if r["expert_action"] and r["expert_action"] not in TURN.drop_labels
                and r["expert_action"] in prev["admissible_commands"]]
        assert want and targets[ep.episode_id] == want
        executed = [r["action"] for r in ep.records[1:]]
        assert targets[ep.episode_id] != executed[:len(want)]  # the policy's commands are history, not targets
    twice = build_traces(episodes, dataclasses.replace(TURN, dagger_weight=2), tmp_path / "twice")
    assert stats["train_rows"] > 0 and twice["train_rows"] == 2 * stats["train_rows"]
    assert twice["valid_rows"] == stats["valid_rows"]
    # expert episodes' examples and the Experience store are the same with or without DAgger episodes
    expert = parse_lines([line for f in sorted((tiny_logs[0] / "logs").glob("*.jsonl"))
                          for line in f.read_text().splitlines()], "tiny")
    alone = build_traces(expert, TURN, tmp_path / "alone", experience_path=tmp_path / "alone.db")
    both = build_traces(expert + episodes, TURN, tmp_path / "both", experience_path=tmp_path / "both.db")
    rows_of = {name: [line for split in ("train", "valid")
                      for line in (tmp_path / name / f"{split}.jsonl").read_text().splitlines()
                      if not json.loads(line)["episode_id"].startswith("dagger-")] for name in ("alone", "both")}
    assert rows_of["alone"] and rows_of["alone"] == rows_of["both"]
    assert both["lessons"] == alone["lessons"] and both["dagger_episodes"] == 3
    history = build_traces(episodes, TraceConfig(context="history", won_only=False), tmp_path / "history")
    assert history["dagger_skipped"] == 3 and history["kept"] == 0


def test_lineage_resolves_aggregated_data_and_names_the_dagger_policy(dagger_logs, tiny_logs, git_repo):
    from evoharness.registry.lineage import LineageError, resolve_data

    shutil.copytree(tiny_logs[0], git_repo / "data")
    shutil.copytree(dagger_logs[0], git_repo / "data-dagger-t")
    datastore.ensure_dvc_repo(git_repo)
    md5s = [datastore.dvc_add(git_repo, p) for p in ("data", "data-dagger-t")]
    git(git_repo, "add", "-A")
    git(git_repo, "commit", "-q", "-m", "data and dagger data")
    assert dagger_policy(git_repo, "HEAD", "data-dagger-t") == "random"
    assert dagger_policy(git_repo, "HEAD", "data") == "unknown"
    tags = {"dvc_md5": "+".join(md5s), "data_path": "data+data-dagger-t", "data_rev": "HEAD"}
    rev, shards = resolve_data(git_repo, tags)
    assert rev == "HEAD" and [p.split("/")[0] for p, _ in shards].count("data-dagger-t") == 1
    with pytest.raises(LineageError, match="naming md5"):
        resolve_data(git_repo, tags | {"dvc_md5": f"{md5s[0]}+0123.dir"})
    with pytest.raises(LineageError, match="2 folders"):
        resolve_data(git_repo, tags | {"dvc_md5": md5s[0]})
