"""The committed releases (``models/<name>/``): complete, within 25 MiB, their cards state their evaluation's
figures, and each loads and wins, greedily, a game its recorded evaluation won, replaying that episode exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evoharness.registry.model_card import card_figures
from evoharness.registry.release import (
    MAX_RELEASE_BYTES,
    ReleaseError,
    read_release,
    recorded_episodes,
    release_bytes,
)

ROOT = Path(__file__).resolve().parent.parent
RELEASES = sorted(p.parent for p in (ROOT / "models").glob("*/release.json"))


def test_the_default_profile_starts_from_a_committed_release():
    from evoharness.config import load_profile

    path = ROOT / load_profile("default").model.path
    assert path in RELEASES, f"profiles/default.yaml starts from {path}, which is not a committed release"


@pytest.mark.parametrize("release", RELEASES, ids=[p.name for p in RELEASES])
def test_card_states_the_evaluation_summary(release):
    rel = read_release(release)
    assert release_bytes(release) <= MAX_RELEASE_BYTES
    for split, file in rel["evaluations"].items():
        summary = json.loads((release / file).read_text())
        episodes = recorded_episodes(release, split)
        assert {e["game"]: e["won"] for e in episodes} == summary["won_by_game"]
        assert summary["success_rate"] == sum(summary["won_by_game"].values()) / summary["episodes"]
        figures = card_figures((release / "README.md").read_text())
        won = sum(summary["won_by_game"].values())
        assert figures["rows"]["All"] == (summary["episodes"], won, round(100 * summary["success_rate"], 1))
        for t, rate in summary["success_by_task_type"].items():
            n = summary["episodes_by_task_type"][t]
            assert figures["rows"][t] == (n, round(rate * n), round(100 * rate, 1))
        assert figures["per_episode"]["environment steps"] == round(summary["mean_steps"], 2)
        for m, v in summary["meta_actions_per_episode"].items():
            assert figures["per_episode"][m] == round(v, 2)
    card = (release / "README.md").read_text()
    for key in ("git_commit", "profile", "config_digest", "dvc_md5", "trace_hash"):
        assert str(rel["lineage"][key]) in card, f"the card does not state {key}"
    assert f"{rel['training']['steps']:,}" in card and f"{rel['training']['tokens']:,}" in card
    if rel.get("parent"):  # trained further from an earlier release: which one, and the totals
        assert rel["parent"]["git_commit"] in card
        assert f"{rel['training']['steps'] + rel['parent']['steps']:,} in all" in card
        t = rel["parent"].get("paired_test")
        if t:  # its paired test against the parent's recorded outcomes, recomputed from both releases' games
            from evoharness.evaluation.stats import mcnemar_exact

            name = rel["parent"]["name"]
            theirs = json.loads((ROOT / "models" / name / read_release(ROOT / "models" / name)["evaluations"][
                t["split"]]).read_text())["won_by_game"]
            ours = json.loads((release / rel["evaluations"][t["split"]]).read_text())["won_by_game"]
            again = mcnemar_exact(ours, theirs)
            assert (t["only_a"], t["only_b"], t["games"]) == (again["only_a"], again["only_b"], again["games"])
            assert f"{t['only_a']} only by this policy, {t['only_b']} only by the parent" in card
    if rel.get("grpo"):  # trained by GRPO: the reward it maximised, with its weights
        c = rel["cost"]
        assert f"`{c['mode']}`" in card and f"task {c['task_reward']:g} for a win" in card
        assert f"{rel['grpo']['learning_rate']:g}" in card and f"`{rel['grpo']['advantage']}`" in card


@pytest.mark.parametrize("release", RELEASES, ids=[p.name for p in RELEASES])
def test_release_loads_and_wins_a_known_game_greedily(release, tmp_path):
    """The release's known game (``release.json`` ``smoke_game``: a game its evaluation won that replays alone, see
    ``evoharness.registry.release.find_smoke_game``), played alone at its position: won again, in the recorded steps,
    with the recorded meta-actions."""
    from evoharness.registry.release import replay

    known = read_release(release)["smoke_game"]
    recorded = recorded_episodes(release, known["split"])[known["index"]]
    assert recorded["game"] == known["game"] and recorded["won"]
    result = replay(release, known["split"], known["index"], tmp_path)
    assert result.won and result.env_steps == recorded["env_steps"]
    assert result.meta_actions == recorded["meta_actions"]


def test_an_incomplete_release_is_named(tmp_path):
    (tmp_path / "release.json").write_text("{}")
    with pytest.raises(ReleaseError, match="missing .*model.safetensors"):
        read_release(tmp_path)


@pytest.mark.parametrize("release", RELEASES, ids=[p.name for p in RELEASES])
def test_grpo_from_a_release_folder_takes_its_recorded_outcomes_as_the_parents(release, tmp_path):
    """--sft-model models/<name>: the parent's outcomes on the evaluated games are the release's recorded ones (an
    MLflow run records them) when the evaluation settings are the release's; other settings replay it (None)."""
    import dataclasses

    import mlflow
    from prefect import flow

    from evoharness.env.alfworld import list_games
    from evoharness.evaluation.evaluate import spread
    from evoharness.registry.release import play_settings
    from evoharness.registry.tracking import configure
    from tasks.evaluation import release_folder_evaluation

    # configure: a fresh store with its experiment selected (the experiment id an earlier test selected may not
    # exist in this store).
    configure(tmp_path)
    cfg, _ = play_settings(release, {"limit": 60})
    recorded = {e["game"]: e["won"] for e in recorded_episodes(release, cfg.split)}

    @flow
    def parent_outcomes(c):
        return release_folder_evaluation(str(release), c)

    summary = parent_outcomes(cfg)
    games = spread(list_games(cfg.split), 60)
    assert summary["games"] == games and summary["won_by_game"] == {g: recorded[g] for g in games}
    run = mlflow.get_run(summary["mlflow_run_id"])
    assert run.data.tags["recorded_in_release"] == "true" and run.data.params["evaluate.limit"] == "60"
    assert parent_outcomes(dataclasses.replace(cfg, decoding="remap")) is None


def test_the_lineage_of_a_release_trained_from_another_names_its_parent(tmp_path):
    """A release trained further from another (its ``release.json`` ``parent``), registered in a fresh store: the
    audit names the parent release, its commit and the paired test the card states."""
    from mlflow import MlflowClient

    from evoharness.registry.lineage import audit_release
    from evoharness.registry.release import register_release
    from evoharness.registry.tracking import configure

    release = next((r for r in RELEASES if read_release(r).get("parent")), None)
    if release is None:
        pytest.skip("no committed release names a parent release")
    parent = read_release(release)["parent"]
    configure(tmp_path)
    info = register_release(release, "evoharness-policy")
    lines = []
    audit = audit_release("evoharness-policy", info["version"], MlflowClient().get_model_version(
        "evoharness-policy", info["version"]), ROOT, out=lines.append)
    assert audit["parent"]["git_commit"] == parent["git_commit"]
    assert any(line.startswith(f"parent     release {parent['name']} as of git {parent['git_commit']}")
               for line in lines)
    t = parent["paired_test"]
    assert any(f"{t['only_a']} won only by this policy, {t['only_b']} only by the parent" in line for line in lines)
