"""End to end: the real Prefect flow on 3 real games with tiny settings, in a temporary git+DVC repo."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import time

import pytest

from conftest import TINY_COLLECT, git, make_git_repo
from evoharness.data.datastore import DataVersionMismatch, ensure_data
from evoharness.data.rawlog import dvc_md5

pytestmark = pytest.mark.slow  # real flow runs: `make test-fast` leaves them out

STAGES = {"collect", "ingest", "build_traces", "sft", "grpo", "register", "evaluate-valid_seen",
          "evaluate-parent-valid_seen", "promote"}


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
    # each evaluated game's outcome, for paired tests from the summary alone (scripts/paired_test.py)
    assert len(s["won_by_game"]) == 2 and all(g.startswith("valid_seen/") for g in s["won_by_game"])
    assert sum(s["won_by_game"].values()) / 2 == s["success_rate"]
    assert set(s["parent_evaluation"]["won_by_game"]) == set(s["won_by_game"])  # the SFT policy, the same games
    assert set(s["stage_wall_s"]) == {"collect", "ingest", "build_traces", "sft", "grpo", "register", "evaluate",
                                      "promote"}
    assert not any(s["stage_cached"].values())
    assert set(s["grpo_meta_actions_per_episode"]["first_step"]) == {"track", "commit", "recall", "note"}
    assert s["data"]["md5"] == dvc_md5(pipeline_repo) and s["data"]["status"] == "collected"
    assert (pipeline_repo / "summary.json").exists()
    assert s["model_uri"] == "models:/evoharness-policy/1"
    # no sft.time_budget_s in `tiny`: no plan, and the epoch, not the time guard, ended training
    assert s["sft"]["global_step"] > 0 and s["sft"]["time_budget"] is None and s["sft"]["stopped_by_time_limit"] is False


def test_mlflow_runs_metrics_registry_and_lineage(first_run, pipeline_repo):
    from mlflow import MlflowClient

    use_store(pipeline_repo)
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
    assert sft.data.tags["sft.stopped_by_time_limit"] == "false"
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


def use_store(repo):
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{repo / 'mlflow' / 'mlflow.db'}")


def test_promotion_moves_champion_only_when_not_worse(first_run, pipeline_repo):
    from mlflow import MlflowClient

    use_store(pipeline_repo)
    decision = first_run["promotion"]
    assert decision["promoted"] and decision["champion_version"] is None  # the first model becomes champion
    client = MlflowClient()
    assert str(client.get_model_version_by_alias("evoharness-policy", "champion").version) == "1"
    tags = client.get_model_version("evoharness-policy", "1").tags
    assert tags["evaluation_run_ids"].split(",")[0] == first_run["evaluation_run_id"]
    assert tags["parent_evaluation_run_id"] == first_run["parent_evaluation"]["mlflow_run_id"]


def test_pinned_rerun_and_registered_model_evaluation(first_run, pipeline_repo):
    from flows.evaluate import evaluate_flow
    from flows.pipeline import pipeline

    rev = git(pipeline_repo, "rev-parse", "HEAD")
    second = pipeline(profile="tiny", repo=str(pipeline_repo), data_rev=rev)
    # pinned: the rev's version is in the DVC cache, the workspace untouched
    assert second["data"]["status"] == "cached"
    assert second["stage_cached"] == {"collect": False, "ingest": False, "build_traces": True, "sft": True,
                                      "grpo": True, "register": False, "evaluate": False, "promote": False}
    assert second["traces"]["content_hash"] == first_run["traces"]["content_hash"]
    assert second["lineage"]["data_rev"] == rev and second["model_uri"] == "models:/evoharness-policy/2"
    pr = second["promotion"]
    assert pr["champion_version"] == "1" and pr["champion_success_rate"] == first_run["success_rate"]
    assert pr["promoted"] == (pr["candidate_success_rate"] >= pr["champion_success_rate"])
    ev = evaluate_flow("models:/evoharness-policy@candidate", split="valid_seen", limit=1, profile="tiny",
                       repo=str(pipeline_repo))
    assert ev["episodes"] == 1 and ev["model_uri"] == "models:/evoharness-policy@candidate"
    work = pipeline_repo / "runs" / "expert-eval"
    expert = evaluate_flow("expert", split="valid_train", limit=2, profile="tiny", repo=str(pipeline_repo),
                           work_dir=str(work))
    assert expert["episodes"] == 2 and expert["split"] == "valid_train" and expert["resumed_episodes"] == 0
    # resumed by naming the folder that holds the transcripts: played there again, not in a nested new one
    again = evaluate_flow("expert", split="valid_train", limit=2, profile="tiny", repo=str(pipeline_repo),
                          work_dir=str(work / "evaluate-valid_train"))
    assert again["resumed_episodes"] == 2 and again["success_rate"] == expert["success_rate"]
    assert not (work / "evaluate-valid_train" / "evaluate-valid_train").exists()


def test_grpo_from_a_registered_sft_model_reuses_its_evaluation(first_run, pipeline_repo):
    """--sft-model: GRPO starts from a registered version (no SFT training), the lineage names that version, and
    the parent's evaluation on the same games and settings is the one already recorded on it, not replayed."""
    from flows.pipeline import pipeline

    use_store(pipeline_repo)
    run = pipeline(profile="tiny", repo=str(pipeline_repo), sft_model="models:/evoharness-policy/1")
    assert run["lineage"]["parent_model_uri"] == "models:/evoharness-policy/1"
    assert run["sft"]["global_step"] is None and run["grpo_steps"] == 2  # nothing trained before GRPO
    assert run["parent_evaluation"]["mlflow_run_id"] == first_run["evaluation_run_id"]
    assert run["parent_evaluation"]["success_rate"] == first_run["success_rate"]
    with pytest.raises(ValueError, match="--until grpo"):
        pipeline(profile="tiny", repo=str(pipeline_repo), sft_model="models:/evoharness-policy/1", until="sft")


def test_sft_trains_further_from_a_registered_version(first_run, pipeline_repo, tmp_path):
    """model.path: models:/NAME/VERSION: SFT starts from that version's weights and tokenizer, and the new
    version's lineage names it (an auditor sees which model it was trained from)."""
    from mlflow import MlflowClient

    from evoharness.evaluation.evaluate import resolve_model_path
    from evoharness.training.model import load_policy
    from flows.pipeline import pipeline

    profile = tmp_path / "tiny-further.yaml"
    profile.write_text("extends: tiny\nmodel:\n  path: models:/evoharness-policy/1\nsft:\n  max_steps: 1\n"
                       "registered_model_name: evoharness-policy-further\n")
    run = pipeline(profile=str(profile), repo=str(pipeline_repo), until="sft")
    assert run["sft"]["global_step"] == 1 and run["lineage"]["base_model"] == "models:/evoharness-policy/1"
    # the same first batch: from the parent's trained weights its loss is lower than from a fresh model's
    assert run["sft"]["first_loss"] < first_run["sft"]["first_loss"]
    use_store(pipeline_repo)
    client = MlflowClient()
    version = client.get_model_version_by_alias("evoharness-policy-further", "candidate")
    assert version.tags["base_model"] == "models:/evoharness-policy/1"
    sft_run = client.get_run(run["lineage"]["parent_model_run_id"])
    assert sft_run.data.tags["parent_model"] == "models:/evoharness-policy/1"
    assert sft_run.data.tags["parent_model_run_id"] == client.get_model_version("evoharness-policy", "1").run_id
    _, parent_tok = load_policy(resolve_model_path("models:/evoharness-policy/1", tmp_path / "parent"))
    _, tok = load_policy(resolve_model_path(run["model_uri"], tmp_path / "further"))
    assert tok.get_vocab() == parent_tok.get_vocab()  # the parent's tokenizer, not a new one


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
    assert not (git_repo / "data").exists() and list(git_repo.glob("data.mismatch-*/logs/shard-00000.jsonl"))
    with pytest.raises(DataVersionMismatch):  # a retry regenerates and fails again: no silent new version
        ensure_data(git_repo, dataclasses.replace(TINY_COLLECT, seed=7), tiny_games)
    assert (git_repo / "data.dvc").read_text() == before


def run_lineage(repo, uri):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "evoharness.registry.lineage", uri, "--repo", str(repo)],
                          capture_output=True, text=True, timeout=300)


def test_lineage_command_verifies_and_fails_on_a_deleted_cache_entry(first_run, pipeline_repo, tmp_path):
    ok = run_lineage(pipeline_repo, "models:/evoharness-policy/1")  # first_run's version: no other test needed
    assert ok.returncode == 0, ok.stderr
    assert "resolves, md5 matches" in ok.stdout and "lineage check passed" in ok.stdout
    assert f"DVC md5 {first_run['data']['md5']}" in ok.stdout
    assert "harness use, model vs its parent" in ok.stdout and "commit" in ok.stdout
    broken = tmp_path / "broken"
    shutil.copytree(pipeline_repo, broken, symlinks=True)
    shutil.rmtree(broken / "data")
    md5 = first_run["data"]["md5"].removesuffix(".dir")
    (broken / ".dvc" / "cache" / "files" / "md5" / md5[:2] / (md5[2:] + ".dir")).unlink()
    bad = run_lineage(broken, "models:/evoharness-policy/1")
    assert bad.returncode == 1
    assert "lineage check FAILED" in bad.stderr and "do not resolve through DVC" in bad.stderr
    missing = run_lineage(pipeline_repo, "models:/evoharness-policy@nonexistent")
    assert missing.returncode == 2 and "cannot resolve" in missing.stderr


def test_mlflow_ui_screenshot_of_the_grpo_run(first_run, pipeline_repo, tmp_path):
    import subprocess
    import sys

    if not shutil.which("chromium"):
        pytest.skip("Chromium is not installed here (.ci/run installs Debian's chromium): no browser check")
    out = tmp_path / "grpo.png"
    proc = subprocess.run([sys.executable, "scripts/mlflow_screenshot.py", "--repo", str(pipeline_repo),
                           "--model", "models:/evoharness-policy/1", "--out", str(out)],
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "run page and chart rendered: True" in proc.stdout
    assert out.stat().st_size > 20_000  # a rendered page, not a blank one


def test_deployment_on_a_real_prefect_server_and_worker(first_run, tiny_release, pipeline_repo, tmp_path):
    """`scripts/deploy.sh` (what `make deploy` runs): real server + worker on loopback, the weekly deployment run
    twice, pinned, with the retraining of the `default` profile on tiny settings (start from the champion or the
    release, fine-tune, GRPO, compare with the parent); lineage tags and aliases in MLflow; identical data and trace
    hashes; every process stopped."""
    import os
    import socket
    import subprocess

    from mlflow import MlflowClient

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    state = tmp_path / "deploy"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env |= {"PREFECT_PORT": str(port), "PY": os.path.join(root, ".venv", "bin", "python"),
            "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(tmp_path / "results")}
    api = {**env, "PREFECT_API_URL": f"http://127.0.0.1:{port}/api", "PREFECT_HOME": str(state / "home")}
    prefect = os.path.join(root, ".venv", "bin", "prefect")
    rev = git(pipeline_repo, "rev-parse", "HEAD")
    retrain = tmp_path / "tiny-retrain.yaml"  # the default profile's retraining, on tiny settings
    retrain.write_text(f"extends: tiny\nmodel:\n  path: {tiny_release}\n  from_champion: true\nsft:\n  max_steps: 1\n")
    use_store(pipeline_repo)
    client = MlflowClient()
    try:
        start = subprocess.run(["scripts/deploy.sh", "start", str(state)], cwd=root, env=env, capture_output=True,
                               text=True, timeout=300)
        assert start.returncode == 0, start.stderr + (state / "deploy.log").read_text()
        pids = [int((state / f).read_text()) for f in ("server.pid", "worker.pid")]
        ls = subprocess.run([prefect, "deployment", "ls"], env=api, capture_output=True, text=True, timeout=120)
        assert all(d in ls.stdout for d in ("evoharness-pipeline/weekly", "evoharness-collect/collect",
                                            "evoharness-evaluate/evaluate", "evoharness-dagger/dagger"))
        versions = []
        for _ in range(2):
            run = subprocess.run(
                [prefect, "--no-prompt", "deployment", "run", "evoharness-pipeline/weekly", "--param", f"profile={retrain}",
                 "--param", f"data_rev={rev}", "--param", f"repo={pipeline_repo}", "--param", "limit=1",
                 "--watch", "--watch-timeout", "900"], cwd=root, env=api, capture_output=True, text=True, timeout=1000)
            assert run.returncode == 0 and "Completed" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
            latest = max(client.search_model_versions("name='evoharness-policy'"), key=lambda v: int(v.version))
            versions.append(latest)
        a, b = (v.tags for v in versions)
        assert a["data_rev"] == b["data_rev"] == rev
        assert a["dvc_md5"] == b["dvc_md5"] == first_run["data"]["md5"]
        assert a["trace_hash"] == b["trace_hash"] == first_run["traces"]["content_hash"]
        assert a["prefect_deployment_id"] and a["prefect_flow_run_id"] != b["prefect_flow_run_id"]
        assert a["started_from"] == b["started_from"] == "champion"  # the registry has one: retrain it
        assert a["parent_model_uri"].startswith("models:/evoharness-policy/")
        assert "candidate" in client.get_model_version("evoharness-policy", versions[1].version).aliases
        assert client.get_model_version_by_alias("evoharness-policy", "champion").version
        # a stop during a run: the run is cancelled through Prefect and its MLflow runs closed as KILLED
        third = subprocess.run(
            [prefect, "--no-prompt", "deployment", "run", "evoharness-pipeline/weekly", "--param", f"profile={retrain}",
             "--param", f"repo={pipeline_repo}", "--param", "limit=1"], cwd=root, env=api, capture_output=True,
            text=True, timeout=120)
        flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", third.stdout).group(1)
        query = f"tags.prefect_flow_run_id = '{flow_run_id}'"
        experiments = [e.experiment_id for e in client.search_experiments()]
        deadline = time.time() + 300
        while not client.search_runs(experiments, query) and time.time() < deadline:
            time.sleep(2)
        assert client.search_runs(experiments, query), "the third run never started its MLflow run"
        stop = subprocess.run(["scripts/deploy.sh", "stop", str(state)], cwd=root, env=env, capture_output=True,
                              text=True, timeout=300)
        assert re.search(f"flow run .* \\({flow_run_id}\\): Cancelled; MLflow runs closed as KILLED: \\w", stop.stdout), \
            stop.stdout + stop.stderr
        parent = client.search_runs(experiments, query)[0]
        assert parent.info.status == "KILLED" and "deployments stopped" in parent.data.tags["killed_reason"]
    finally:
        stop = subprocess.run(["scripts/deploy.sh", "stop", str(state)], cwd=root, env=env, capture_output=True,
                              text=True, timeout=300)
    assert stop.returncode == 0
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def test_edited_logs_are_not_silently_a_new_version(git_repo, tiny_games):
    first = ensure_data(git_repo, TINY_COLLECT, tiny_games)
    git(git_repo, "add", "-A")
    git(git_repo, "commit", "-qm", "data")
    before = (git_repo / "data.dvc").read_text()
    shard = git_repo / "data" / "logs" / "shard-00000.jsonl"
    shard.write_text(shard.read_text() + "\n")
    for _ in range(2):  # a retry must fail the same way, not accept the edit
        with pytest.raises(DataVersionMismatch,
                           match=f"data.dvc names md5 {first['md5']}, but .*data/ \\(the logs there now\\) has md5"):
            ensure_data(git_repo, TINY_COLLECT, tiny_games)
    assert (git_repo / "data.dvc").read_text() == before


def test_a_clone_pulls_the_pushed_version_from_the_default_remote(tmp_path, git_repo, tiny_games):
    """A tracked folder other than data/, pushed to a local directory remote outside the repo, comes back in a fresh
    clone (no DVC cache) through `dvc pull`, byte for byte, without playing a game."""
    from evoharness.data.datastore import default_remote, ensure_dvc_repo

    ensure_dvc_repo(git_repo)
    with (git_repo / ".dvc" / "config").open("a") as fh:
        fh.write("    remote = local\n['remote \"local\"']\n    url = ../../remote\n")
    assert default_remote(git_repo) == str(tmp_path / "remote")
    cfg = dataclasses.replace(TINY_COLLECT, path="logs-v1")
    first = ensure_data(git_repo, cfg, tiny_games)
    assert first["status"] == "collected" and first["pushed"] > 0 and (git_repo / "logs-v1.dvc").exists()
    assert ensure_data(git_repo, cfg, tiny_games)["pushed"] == 0  # already there
    git(git_repo, "add", "-A")
    git(git_repo, "commit", "-qm", "logs-v1")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(git_repo), str(clone)], check=True)
    again = ensure_data(clone, cfg, games=[])  # nothing to play: the data can only come from the remote
    assert again["status"] == "pulled" and again["md5"] == first["md5"]
    shard = "logs-v1/logs/shard-00000.jsonl"
    assert (clone / shard).read_bytes() == (git_repo / shard).read_bytes()


def test_dagger_episodes_of_a_registered_version_train_the_next_one_with_lineage(first_run, pipeline_repo, tmp_path):
    """flows.dagger: version 1 plays, the expert labels, the logs become their own DVC version; a profile with
    ingest.dagger aggregates them with the expert logs, and the new version's lineage names both data versions and
    the policy that played (the lineage command verifies them)."""
    from flows.dagger import dagger_flow
    from flows.pipeline import pipeline

    out = dagger_flow("models:/evoharness-policy/1", "t", profile="tiny", num_games=2, workers=1,
                      repo=str(pipeline_repo))
    assert out["status"] == "collected" and out["episodes"] == 2 and out["labelled_steps"] > 0
    assert dvc_md5(pipeline_repo, dvc_file="data-dagger-t.dvc") == out["md5"]
    again = dagger_flow("models:/evoharness-policy/1", "t", profile="tiny", num_games=2, workers=1,
                        repo=str(pipeline_repo))
    assert again["status"] == "present" and again["md5"] == out["md5"]
    shutil.rmtree(pipeline_repo / "data-dagger-t")  # a checkout without the folder: restored from the DVC cache
    restored = dagger_flow("models:/evoharness-policy/1", "t", profile="tiny", num_games=2, workers=1,
                           repo=str(pipeline_repo))
    assert restored["status"] == "present" and restored["md5"] == out["md5"]
    with pytest.raises(ValueError, match="use another --tag"):
        dagger_flow("models:/evoharness-policy/1", "t", profile="tiny", num_games=3, workers=1, repo=str(pipeline_repo))
    profile = tmp_path / "tiny-dagger.yaml"
    # a new model: version 1 reads the history layout, these traces are turn-layout (the SFT stage refuses a mix)
    profile.write_text("extends: tiny\nsft:\n  max_steps: 1\n"
                       "traces:\n  context: turn\ningest:\n  dagger: [data-dagger-t]\n"
                       "registered_model_name: evoharness-policy-dagger\n")
    run = pipeline(profile=str(profile), repo=str(pipeline_repo), until="sft")
    lineage = run["lineage"]
    assert lineage["data_path"] == "data+data-dagger-t"
    assert lineage["dvc_md5"] == f"{dvc_md5(pipeline_repo)}+{out['md5']}"
    assert lineage["dagger_policy.data-dagger-t"] == "models:/evoharness-policy/1"
    assert run["traces"]["dagger_episodes"] == 2
    git(pipeline_repo, "add", "-A")
    git(pipeline_repo, "commit", "-qm", "dagger data")
    ok = run_lineage(pipeline_repo, run["model_uri"])
    assert ok.returncode == 0, ok.stderr
    assert "data-dagger-t/logs/dagger-t-00000.jsonl" in ok.stdout and "lineage check passed" in ok.stdout
    assert "data-dagger-t/ holds episodes models:/evoharness-policy/1 played" in ok.stdout


def test_work_folder_resumes_in_the_evaluate_folder_it_is_given(tmp_path):
    """`--work-dir` names the folder above `evaluate-<split>` or that folder itself; a folder an earlier run already
    nested (`evaluate-<split>/evaluate-<split>`, before 2026-12-02) is resumed where it is."""
    from flows.evaluate import work_folder

    ev = tmp_path / "run" / "evaluate-valid_seen"
    assert work_folder(str(tmp_path / "run"), "valid_seen") == tmp_path / "run"
    assert work_folder(str(ev), "valid_seen") == tmp_path / "run"
    assert work_folder(str(ev), "valid_train") == ev  # another split's folder is only a folder
    (ev / "evaluate-valid_seen").mkdir(parents=True)
    assert work_folder(str(ev), "valid_seen") == ev


# --- releases: a policy folder that outlives its machine, and the main job that retrains from it ------------------


@pytest.fixture(scope="module")
def tiny_release(first_run, pipeline_repo):
    """first_run's policy exported as a release folder, as `python -m evoharness.registry.release export` writes one."""
    import json

    from evoharness.config import load_profile
    from evoharness.registry.release import export_release, training_from

    paths = first_run["paths"]
    result = json.loads((pipeline_repo / paths["sft_dir"] / "result.json").read_text())
    training = training_from(first_run, result, paths["final_path"], "the test machine")
    return export_release(pipeline_repo / "models" / "tiny-release", paths["final_path"], paths["experience_path"],
                          first_run, paths["transcripts"], load_profile("tiny"), "pipeline(profile='tiny')", training)


def test_release_folder_and_card_state_the_summary_figures(first_run, tiny_release):
    from evoharness.registry.model_card import card_figures
    from evoharness.registry.release import MAX_RELEASE_BYTES, read_release, release_bytes
    from evoharness.training.model import load_policy

    rel = read_release(tiny_release)
    assert rel["lineage"]["trace_hash"] == first_run["traces"]["content_hash"]
    assert rel["lineage"]["dvc_md5"] == first_run["data"]["md5"] and rel["evaluate"]["max_env_steps"] == 3
    assert {"model.safetensors", "tokenizer.json", "chat_template.jinja", "generation_config.json",
            "experience.db", "README.md"} <= {p.name for p in tiny_release.iterdir()}
    assert release_bytes(tiny_release) < MAX_RELEASE_BYTES
    figures = card_figures((tiny_release / "README.md").read_text())
    n, won = first_run["episodes"], sum(first_run["won_by_game"].values())
    assert figures["rows"]["All"] == (n, won, round(100 * first_run["success_rate"], 1))
    for t, rate in first_run["success_by_task_type"].items():
        k = first_run["episodes_by_task_type"][t]
        assert figures["rows"][t] == (k, round(rate * k), round(100 * rate, 1))
    assert figures["per_episode"]["environment steps"] == round(first_run["mean_steps"], 2)
    assert figures["per_episode"]["track"] == round(first_run["meta_actions_per_episode"]["track"], 2)
    model, tokenizer = load_policy(str(tiny_release))
    assert model.config.evoharness_layout["context"] == "history" and tokenizer.chat_template


def test_a_release_evaluates_with_its_own_settings_and_gives_back_its_figures(first_run, tiny_release, pipeline_repo):
    """`flows.evaluate --policy models/<release>` and no profile: the release's budgets (tiny's 3 steps, not the
    default profile's 50) and Experience store, so the same games give the same outcomes, steps and tokens."""
    from flows.evaluate import evaluate_flow

    ev = evaluate_flow(str(tiny_release), split="valid_seen", limit=2, repo=str(pipeline_repo))
    assert ev["won_by_game"] == first_run["won_by_game"]
    assert ev["mean_steps"] == first_run["mean_steps"] <= 3
    assert ev["generated_tokens_per_episode"] == first_run["generated_tokens_per_episode"]
    shorter = evaluate_flow(str(tiny_release), split="valid_seen", limit=2, repo=str(pipeline_repo),
                            overrides=["evaluate.max_env_steps=1"])  # a dotted override beats the release's own
    assert shorter["mean_steps"] <= 1


def test_register_release_and_its_lineage(first_run, tiny_release, pipeline_repo):
    import subprocess
    import sys

    from mlflow import MlflowClient

    cmd = [sys.executable, "-m", "evoharness.registry.release", "register", str(tiny_release),
           "--name", "evoharness-released",
           "--repo", str(pipeline_repo)]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "registered as models:/evoharness-released/1" in first.stdout
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert "already registered as models:/evoharness-released/1" in again.stdout
    use_store(pipeline_repo)
    tags = MlflowClient().get_model_version("evoharness-released", "1").tags
    assert tags["release"] == "tiny-release" and tags["source_commit"] == first_run["lineage"]["git_commit"]
    assert tags["trace_hash"] == first_run["traces"]["content_hash"] and tags["dvc_md5"] == first_run["data"]["md5"]
    assert tags["config_digest"] == first_run["lineage"]["config_digest"]
    audit = run_lineage(pipeline_repo, "models:/evoharness-released/1")
    assert audit.returncode == 0, audit.stderr
    assert "training run is NOT in this store" in audit.stdout and f"names md5 {first_run['data']['md5']}: matches" \
        in audit.stdout


def test_the_main_job_retrains_from_the_release_then_from_the_champion(first_run, tiny_release, pipeline_repo,
                                                                      tmp_path):
    """model.from_champion: with no champion the release is registered and is the parent; the candidate and the
    parent are compared on the same games, the parent's outcomes taken from the release's record, with a paired
    test; the next run starts from the champion, and a candidate below promote.min_success is never champion."""
    from mlflow import MlflowClient

    from flows.pipeline import pipeline

    def profile(floor):
        path = tmp_path / f"retrain-{floor}.yaml"
        path.write_text(f"extends: tiny\nmodel:\n  path: {tiny_release}\n  from_champion: true\nsft:\n  max_steps: 1\n"
                        f"promote:\n  min_success: {floor}\nregistered_model_name: evoharness-retrain\n")
        return str(path)

    run = pipeline(profile=profile(0.0), repo=str(pipeline_repo))
    assert run["lineage"]["started_from"] == "release"
    assert run["lineage"]["parent_model_uri"] == run["parent_model_uri"] == "models:/evoharness-retrain/1"
    assert run["parent_evaluation"]["won_by_game"] == first_run["won_by_game"]  # recorded, not replayed
    use_store(pipeline_repo)
    client = MlflowClient()
    recorded = client.get_run(run["parent_evaluation"]["mlflow_run_id"])
    assert recorded.data.tags["recorded_in_release"] == "true"
    t = run["paired_test"]
    assert t["games"] == 2 and t["won_a"] == sum(run["won_by_game"].values())
    assert t["won_b"] == sum(first_run["won_by_game"].values())
    assert run["promotion"]["champion_version"] == "1"  # the release became champion at registration
    second = pipeline(profile=profile(1.0), repo=str(pipeline_repo))
    assert second["lineage"]["started_from"] == "champion"
    champion = run["promotion"]["candidate_version"] if run["promotion"]["promoted"] else "1"
    assert second["parent_model_uri"] == f"models:/evoharness-retrain/{champion}"
    assert second["promotion"]["promoted"] is False and "floor" in second["promotion"]["reason"]
    assert str(client.get_model_version_by_alias("evoharness-retrain", "champion").version) == champion
