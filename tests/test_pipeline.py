"""End to end: the real Prefect flow on 3 real games with tiny settings, in a temporary git+DVC repo."""

from __future__ import annotations

import dataclasses
import shutil

import pytest

from conftest import TINY_COLLECT, git, make_git_repo
from evoharness.datastore import DataVersionMismatch, ensure_data
from evoharness.rawlog import dvc_md5

STAGES = {"collect", "ingest", "build_traces", "sft", "grpo", "register", "evaluate-valid_seen"}


@pytest.fixture(scope="module")
def prefect_backend():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90):
        yield


@pytest.fixture(scope="module")
def pipeline_repo(tmp_path_factory):
    return make_git_repo(tmp_path_factory.mktemp("pipeline") / "repo")


@pytest.fixture(scope="module")
def first_run(prefect_backend, pipeline_repo):
    from flows.pipeline import pipeline

    summary = pipeline(profile="tiny", repo=str(pipeline_repo), summary_json=str(pipeline_repo / "summary.json"))
    git(pipeline_repo, "add", "-A")
    git(pipeline_repo, "commit", "-qm", "data v1")
    return summary


def test_pipeline_summary(first_run, pipeline_repo):
    s = first_run
    assert s["episodes"] == 2 and s["games_in_split"] == 140 and s["split"] == "valid_seen"
    assert 0.0 <= s["success_rate"] <= 1.0
    assert set(s["stage_wall_s"]) == {"collect", "ingest", "build_traces", "sft", "grpo", "register", "evaluate"}
    assert set(s["grpo_meta_actions_per_episode"]["first_step"]) == {"track", "commit", "recall", "note"}
    assert s["data"]["md5"] == dvc_md5(pipeline_repo) and s["data"]["status"] == "collected"
    assert (pipeline_repo / "summary.json").exists()
    assert s["model_uri"] == "models:/evoharness-policy/1"


def test_mlflow_runs_metrics_registry_and_lineage(first_run, pipeline_repo):
    import mlflow
    from mlflow import MlflowClient

    mlflow.set_tracking_uri(f"sqlite:///{pipeline_repo / 'mlflow' / 'mlflow.db'}")
    client = MlflowClient()
    parent = client.get_run(first_run["mlflow_run_id"])
    assert parent.data.tags["git_commit"] == git(pipeline_repo, "rev-parse", "HEAD~1")
    assert parent.data.tags["profile"] == "tiny" and parent.data.tags["prefect_flow_run_id"]
    assert parent.data.tags["dvc_md5"] == dvc_md5(pipeline_repo) and parent.data.tags["data_rev"] == "workspace"
    assert parent.data.tags["trace_hash"] == first_run["traces"]["content_hash"]
    children = client.search_runs([parent.info.experiment_id],
                                  f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    by_name = {r.info.run_name: r for r in children}
    assert set(by_name) == STAGES
    grpo = by_name["grpo"]
    history = client.get_metric_history(grpo.info.run_id, "rollout/meta_actions")
    assert [m.step for m in history] == [0, 1]
    assert "annealing.png" in [a.path for a in client.list_artifacts(grpo.info.run_id)]
    sft = by_name["sft"]
    assert client.get_metric_history(sft.info.run_id, "loss"), "SFT loss curve missing"
    assert by_name["build_traces"].data.tags["trace_hash"] == first_run["traces"]["content_hash"]
    ev = by_name["evaluate-valid_seen"].data.metrics
    assert ev["episodes"] == 2 and ev["success_rate"] == first_run["success_rate"]
    version = client.get_model_version_by_alias("evoharness-policy", "candidate")
    assert str(version.version) == "1"
    tags = version.tags
    assert tags["dvc_md5"] == dvc_md5(pipeline_repo)
    assert tags["trace_hash"] == first_run["traces"]["content_hash"]
    assert tags["git_commit"] == parent.data.tags["git_commit"] and tags["git_dirty"] in ("true", "false")
    assert tags["parent_model_run_id"] == sft.info.run_id and tags["data_rev"] == "workspace"


def test_pinned_rerun_and_registered_model_evaluation(first_run, pipeline_repo):
    from flows.evaluate import evaluate_flow
    from flows.pipeline import pipeline

    rev = git(pipeline_repo, "rev-parse", "HEAD")
    second = pipeline(profile="tiny", repo=str(pipeline_repo), data_rev=rev)
    assert second["data"]["status"] == "present"
    assert second["traces"]["content_hash"] == first_run["traces"]["content_hash"]
    assert second["lineage"]["data_rev"] == rev and second["model_uri"] == "models:/evoharness-policy/2"
    ev = evaluate_flow("models:/evoharness-policy@candidate", split="valid_seen", limit=1, profile="tiny",
                       repo=str(pipeline_repo))
    assert ev["episodes"] == 1 and ev["model_uri"] == "models:/evoharness-policy@candidate"
    expert = evaluate_flow("expert", split="valid_train", limit=2, profile="tiny", repo=str(pipeline_repo))
    assert expert["episodes"] == 2 and expert["split"] == "valid_train"


def test_fresh_clone_regenerates_the_committed_version(git_repo, tiny_games):
    """No cache holds data.dvc's version: regenerate, check the md5; other settings must fail loudly."""
    first = ensure_data(git_repo, TINY_COLLECT, tiny_games)
    git(git_repo, "add", "-A")
    git(git_repo, "commit", "-qm", "data")
    shutil.rmtree(git_repo / "data")
    shutil.rmtree(git_repo / ".dvc" / "cache")
    again = ensure_data(git_repo, TINY_COLLECT, tiny_games)
    assert again["status"] == "regenerated" and again["md5"] == first["md5"]
    shutil.rmtree(git_repo / "data")
    shutil.rmtree(git_repo / ".dvc" / "cache")
    before = (git_repo / "data.dvc").read_text()
    with pytest.raises(DataVersionMismatch, match=f"data.dvc names md5 {first['md5']}"):
        ensure_data(git_repo, dataclasses.replace(TINY_COLLECT, seed=7), tiny_games)
    assert (git_repo / "data.dvc").read_text() == before
