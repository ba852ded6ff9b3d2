"""evoharness.evaluation.evaluate resumes an interrupted evaluation: finished episodes are kept, environment failures
and
missing games are played, and a folder of another policy is refused. Real games, the real handcoded expert."""

import json

import pytest

from evoharness.config import CostConfig, EvalConfig
from evoharness.evaluation.evaluate import environment_failed, evaluate

CFG = EvalConfig(split="train", limit=0, max_env_steps=50)


def test_environment_failures_are_told_from_policy_outcomes():
    assert environment_failed("reset failed: OSError(28, 'No space left on device')")
    assert environment_failed("could not load game: FileNotFoundError('x')")
    assert environment_failed("env.step('go to desk 1') failed: RuntimeError('engine died')")
    assert not environment_failed("turn budget spent")
    assert not environment_failed("context window full: episode truncated")
    assert not environment_failed(None)


def test_a_killed_evaluation_resumes_and_replays_environment_failures(tmp_path, tiny_games):
    out = tmp_path / "evaluate-train"
    first = evaluate("expert", tiny_games, CFG, CostConfig(), out, progress=None)
    assert first["episodes"] == 3 and first["resumed_episodes"] == 0 and first["environment_failures"] == 0
    rows = [json.loads(x) for x in (out / "transcripts.jsonl").read_text().splitlines()]
    assert [r["game"] for r in rows] == tiny_games
    steps = [r["env_steps"] for r in rows]

    # what a full disk and a kill leave: game 0 finished (marked, to see it is not replayed), game 1's reset
    # failed, game 2 never written but for half a line
    rows[0]["generated_tokens"] = 12345
    rows[1] |= {"won": False, "env_steps": 0, "transcript": [],
                "error": "reset failed: OSError(28, 'No space left on device')"}
    (out / "transcripts.jsonl").write_text(json.dumps(rows[0]) + "\n" + json.dumps(rows[1]) + "\n"
                                           + json.dumps(rows[2])[:40])
    lines = []
    again = evaluate("expert", tiny_games, CFG, CostConfig(), out, progress=lines.append)
    assert again["resumed_episodes"] == 1 and again["episodes"] == 3 and again["environment_failures"] == 0
    assert any("1 of 3 episodes kept, 2 to play (1 of them after an environment failure)" in x for x in lines)
    assert any("not a whole episode" in x for x in lines)
    after = [json.loads(x) for x in (out / "transcripts.jsonl").read_text().splitlines()]
    assert [r["game"] for r in after] == tiny_games  # one row per game, in order
    assert after[0]["generated_tokens"] == 12345  # kept, not replayed
    assert after[1]["error"] is None and after[1]["env_steps"] == steps[1] > 0  # the expert is deterministic
    assert again["success_rate"] == first["success_rate"]

    with pytest.raises(ValueError, match="holds an evaluation of"):
        evaluate("random", tiny_games, CFG, CostConfig(), out, progress=None)
    with pytest.raises(ValueError, match="holds an evaluation of"):  # other costs: other rewards
        evaluate("expert", tiny_games, CFG, CostConfig(per_generated_token=0.5), out, progress=None)
    (out / "evaluation.json").unlink()
    with pytest.raises(ValueError, match="evaluation.json is missing"):  # whose episodes these are is unknown
        evaluate("expert", tiny_games, CFG, CostConfig(), out, progress=None)


def test_a_policy_that_fails_to_load_does_not_claim_the_folder(tmp_path, tiny_games):
    out = tmp_path / "evaluate-train"
    with pytest.raises(OSError):
        evaluate(str(tmp_path / "no-such-model"), tiny_games[:1], CFG, CostConfig(), out, progress=None)
    assert evaluate("expert", tiny_games[:1], CFG, CostConfig(), out, progress=None)["episodes"] == 1


def test_an_episode_whose_game_does_not_load_still_counts_its_grounded_names(tmp_path, tiny_games):
    """A game that cannot load is an environment failure with 0 grounded names, not an unrecorded count: the
    summary's `grounded_names_per_episode` stays a number (None only for episodes kept from older folders)."""
    games = [tiny_games[0], str(tmp_path / "missing" / "game.tw-pddl")]
    s = evaluate("expert", games, CFG, CostConfig(), tmp_path / "evaluate-train", progress=None)
    assert s["environment_failures"] == 1 and s["grounded_names_per_episode"] == 0.0
