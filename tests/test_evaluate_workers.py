"""``evaluate.workers``: the games played in two processes give the rows and summary of one process, in game order;
a sharded evaluation resumes, and never writes over another evaluation's folder. Real games, the real expert."""

import dataclasses
import json

import pytest

from evoharness.config import CostConfig, EvalConfig
from evoharness.evaluation.evaluate import evaluate

CFG = EvalConfig(split="train", limit=0, max_env_steps=50)


def rows(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_two_workers_play_what_one_plays_and_resume(tmp_path, tiny_games):
    one = evaluate("expert", tiny_games, CFG, CostConfig(), tmp_path / "one", progress=None)
    lines = []
    two_cfg = dataclasses.replace(CFG, workers=2)
    two = evaluate("expert", tiny_games, two_cfg, CostConfig(), tmp_path / "two", progress=lines.append)
    assert rows(tmp_path / "two" / "transcripts.jsonl") == rows(tmp_path / "one" / "transcripts.jsonl")
    assert [r["game"] for r in rows(tmp_path / "two" / "transcripts.jsonl")] == tiny_games
    assert one["success_rate"] == two["success_rate"] == 1.0 and two["episodes"] == 3
    drop = ("wall_s",)
    assert {k: v for k, v in two.items() if k not in drop} == {k: v for k, v in one.items() if k not in drop}
    # worker k plays every 2nd game from the k-th, in a folder of its own
    assert [r["game"] for r in rows(tmp_path / "two" / "shard-0-of-2" / "transcripts.jsonl")] == tiny_games[0::2]
    assert [r["game"] for r in rows(tmp_path / "two" / "shard-1-of-2" / "transcripts.jsonl")] == tiny_games[1::2]
    assert any("3 games in 2 processes" in x for x in lines)
    # more workers than games: one process per game
    three = evaluate("expert", tiny_games[:2], dataclasses.replace(CFG, workers=4), CostConfig(), tmp_path / "few",
                     progress=None)
    assert three["episodes"] == 2 and sorted(p.name for p in (tmp_path / "few").glob("shard-*")) == [
        "shard-0-of-2", "shard-1-of-2"]
    # a second call keeps every episode; so does one after a kill that left a shard with half a line
    again = evaluate("expert", tiny_games, two_cfg, CostConfig(), tmp_path / "two", progress=None)
    assert again["resumed_episodes"] == 3 and again["success_rate"] == 1.0
    shard0 = tmp_path / "two" / "shard-0-of-2" / "transcripts.jsonl"
    first_row = shard0.read_text().splitlines()[0]
    shard0.write_text(first_row + "\n" + first_row[:40])
    (tmp_path / "two" / "transcripts.jsonl").unlink()
    resumed = evaluate("expert", tiny_games, two_cfg, CostConfig(), tmp_path / "two", progress=None)
    assert resumed["resumed_episodes"] == 2 and resumed["episodes"] == 3
    assert rows(tmp_path / "two" / "transcripts.jsonl") == rows(tmp_path / "one" / "transcripts.jsonl")
    # the one-process folder is another evaluation (workers is a setting): refused, its rows untouched
    before = (tmp_path / "one" / "transcripts.jsonl").read_text()
    with pytest.raises(ValueError, match="holds an evaluation of"):
        evaluate("expert", tiny_games, two_cfg, CostConfig(), tmp_path / "one", progress=None)
    assert (tmp_path / "one" / "transcripts.jsonl").read_text() == before


def test_one_worker_keeps_the_identity_recorded_before_the_setting_existed():
    assert "workers" not in CFG.identity()
    assert dataclasses.replace(CFG, workers=2).identity()["workers"] == 2
    with pytest.raises(ValueError, match="evaluate.workers"):
        EvalConfig(workers=0)


def _children(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (Linux /proc)."""
    import os

    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return kids


def test_workers_of_a_killed_evaluation_exit_and_a_rerun_resumes(tmp_path):
    """SIGKILL the evaluating process while its 2 workers play: the workers exit too (they would otherwise play
    their shards on as orphans), and a re-run in the same folder keeps the finished episodes and plays the rest."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from evoharness.env.alfworld import list_games

    games = list_games("train", limit=8, stride=400)
    out = tmp_path / "eval"
    cfg = dataclasses.replace(CFG, workers=2)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = ("import dataclasses; from evoharness.config import CostConfig, EvalConfig; "
              "from evoharness.evaluation.evaluate import evaluate; "
              f"evaluate('expert', {games!r}, {cfg!r}, CostConfig(), {str(out)!r}, progress=None)")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=root, start_new_session=True)
    shards = [out / "shard-0-of-2" / "transcripts.jsonl", out / "shard-1-of-2" / "transcripts.jsonl"]
    deadline = time.time() + 300
    while time.time() < deadline and not all(p.exists() and p.read_text().strip() for p in shards):
        time.sleep(0.2)
    workers = [k for k in _children(proc.pid) if b"spawn_main" in open(f"/proc/{k}/cmdline", "rb").read()]
    assert len(workers) == 2
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 30
    while time.time() < deadline and any(os.path.exists(f"/proc/{k}") for k in workers):
        time.sleep(0.2)
    alive = [k for k in workers if os.path.exists(f"/proc/{k}")]
    [os.kill(k, signal.SIGKILL) for k in alive]  # do not leave them behind when the assertion fails
    assert alive == []
    kept = sum(len(p.read_text().splitlines()) for p in shards)
    assert 2 <= kept < len(games) and not (out / "transcripts.jsonl").exists()
    summary = evaluate("expert", games, cfg, CostConfig(), out, progress=None)
    assert summary["episodes"] == len(games) and summary["resumed_episodes"] == kept
    assert [r["game"] for r in rows(out / "transcripts.jsonl")] == games


@pytest.mark.slow
def test_a_local_two_worker_dask_cluster_plays_what_one_process_plays(tmp_path):
    """`evaluate.task_runner: dask`: the evaluation flow's shards run as Prefect tasks on a local Dask cluster of 2
    worker processes (prefect-dask's DaskTaskRunner) and give the rows and per-game outcomes of one process."""
    from conftest import make_git_repo
    from flows.evaluate import evaluate_flow

    repo = make_git_repo(tmp_path / "repo")  # its own MLflow store
    kw = {"split": "valid_train", "limit": 4, "profile": "tiny", "repo": str(repo)}
    steps = "evaluate.max_env_steps=50"  # tiny's budget is a few steps: the expert needs room to win
    one = evaluate_flow("expert", work_dir=str(tmp_path / "one"), overrides=[steps], **kw)
    pool = evaluate_flow("expert", work_dir=str(tmp_path / "pool"), overrides=[steps, "evaluate.workers=2"], **kw)
    two = evaluate_flow("expert", work_dir=str(tmp_path / "dask"), overrides=[
        steps, "evaluate.task_runner=dask", "evaluate.workers=2"], **kw)
    assert len(one["won_by_game"]) == 4 and sum(one["won_by_game"].values()) >= 2
    # per game: the outcome and steps of one process (the expert may take another of two equal objects: its ties
    # follow the process's string hash seed, which the shards pin and the test process does not)
    assert two["won_by_game"] == one["won_by_game"] and two["mean_steps"] == one["mean_steps"]
    folder = tmp_path / "dask" / "evaluate-valid_train"
    assert rows(folder / "transcripts.jsonl") == rows(tmp_path / "pool" / "evaluate-valid_train" / "transcripts.jsonl")
    assert sorted(p.name for p in folder.glob("shard-*")) == ["shard-0-of-2", "shard-1-of-2"]
    with pytest.raises(ValueError, match="evaluate.task_runner is 'ray'"):
        EvalConfig(task_runner="ray")
    assert "task_runner" not in dataclasses.replace(CFG, task_runner="dask").identity()
