"""scripts/paired_test.py: the exact McNemar test on two evaluations, from summaries or transcripts."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import paired_test  # noqa: E402

from evoharness.evaluation.evaluate import summarize  # noqa: E402
from evoharness.policy.agent import EpisodeResult  # noqa: E402


def episode(game: str, won: bool) -> EpisodeResult:
    return EpisodeResult(game=game, task_type=game.split("/")[1].split("-")[0], won=won, env_steps=10,
                         meta_actions={}, generated_tokens=0, cost=0.0, reward=float(won))


def two_evaluations():
    """README item 14's counts: 79 games won by both, 27 by (d) only, 11 by (c) only, 23 by neither (140)."""
    kinds = [(True, True)] * 79 + [(True, False)] * 27 + [(False, True)] * 11 + [(False, False)] * 23
    games = [f"valid_seen/pick_and_place_simple-Apple-None-Desk-{i}/trial_T0/game.tw-pddl" for i in range(140)]
    a = [episode(g, wa) for g, (wa, _) in zip(games, kinds)]
    b = [episode(g, wb) for g, (_, wb) in zip(games, kinds)]
    return a, b


def test_summaries_record_each_games_outcome_and_the_test_reads_them(tmp_path, capsys):
    a, b = two_evaluations()
    sa, sb = summarize(a, "valid_seen", 140), summarize(b, "valid_seen", 140)
    assert sa["won_by_game"][a[80].game] is True and sb["won_by_game"][a[80].game] is False
    assert sum(sa["won_by_game"].values()) == 106 and sum(sb["won_by_game"].values()) == 90
    (tmp_path / "d.json").write_text(json.dumps(sa))
    (tmp_path / "c.json").write_text(json.dumps(sb))
    r = paired_test.main([str(tmp_path / "d.json"), str(tmp_path / "c.json"), "--names", "d", "c"])
    assert (r["games"], r["both"], r["only_a"], r["only_b"], r["neither"]) == (140, 79, 27, 11, 23)
    assert r["p"] == pytest.approx(0.01385, abs=1e-5)  # 2 * P(X <= 11), X ~ Binomial(38, 1/2)
    assert "only d 27, only c 11" in capsys.readouterr().out


def test_transcripts_and_a_summary_compare_over_the_games_in_both(tmp_path):
    a, b = two_evaluations()
    (tmp_path / "transcripts.jsonl").write_text("".join(json.dumps({"game": r.game, "won": r.won, "transcript": []})
                                                        + "\n" for r in a[:100]))
    (tmp_path / "b.json").write_text(json.dumps(summarize(b, "valid_seen", 140)))
    r = paired_test.mcnemar_exact(paired_test.load_outcomes(tmp_path / "transcripts.jsonl"),
                                  paired_test.load_outcomes(tmp_path / "b.json"))
    assert (r["games"], r["both"], r["only_a"], r["only_b"]) == (100, 79, 21, 0)


def test_identical_evaluations_give_p_1_and_bad_files_exit_2_naming_the_file(tmp_path, capsys):
    a, _ = two_evaluations()
    (tmp_path / "a.json").write_text(json.dumps(summarize(a, "valid_seen", 140)))
    assert paired_test.main([str(tmp_path / "a.json"), str(tmp_path / "a.json")])["p"] == 1.0
    old = summarize(a, "valid_seen", 140)
    del old["won_by_game"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    with pytest.raises(SystemExit) as e:
        paired_test.main([str(tmp_path / "old.json"), str(tmp_path / "a.json")])
    assert e.value.code == 2 and "old.json: a summary without 'won_by_game'" in capsys.readouterr().err
    (tmp_path / "broken.jsonl").write_text('{"game": "g", "won": true}\n{"game": "h", "won"\n')
    with pytest.raises(ValueError, match="broken.jsonl, line 2: not JSON"):
        paired_test.load_outcomes(tmp_path / "broken.jsonl")
    (tmp_path / "other.json").write_text(json.dumps({"won_by_game": {"valid_unseen/x/t/game.tw-pddl": True}}))
    with pytest.raises(ValueError, match="share no game"):
        paired_test.mcnemar_exact(paired_test.load_outcomes(tmp_path / "other.json"),
                                  paired_test.load_outcomes(tmp_path / "a.json"))
