import pytest

from evoharness.config import CostConfig
from evoharness.env.alfworld import ALFWorldEnv, StepResult, list_games
from evoharness.harness.workspace import ExperienceStore, Workspace
from evoharness.policy.agent import Decision, closest_admissible, parse_tool_call, run_episode


def test_parse_tool_call():
    text = '<think>\n\n</think>\n\n<tool_call>\n{"name": "act", "arguments": {"command": "go to desk 1"}}\n</tool_call>'
    assert parse_tool_call(text) == ("act", {"command": "go to desk 1"})
    assert parse_tool_call('<tool_call>{"name": "note", "arguments": "{\\"lesson\\": \\"x\\"}"}</tool_call>') == \
        ("note", {"lesson": "x"})
    assert parse_tool_call("<tool_call>{broken</tool_call>") == (None, {})
    assert parse_tool_call("go to desk 1") == (None, {})


def test_closest_admissible():
    adm = ["go to desk 1", "go to drawer 1", "take pen 1 from desk 1"]
    assert closest_admissible("go to desk 1", adm) == "go to desk 1"
    assert closest_admissible("go to dsk 1", adm) == "go to desk 1"
    assert closest_admissible("take pen 1 from desk", adm) == "take pen 1 from desk 1"


class Scripted:
    """Replays a fixed list of decisions (then the expert's action), counting generated tokens as 5 per turn."""

    def __init__(self, script):
        self.script = list(script)
        self.generated_tokens = 0

    def start(self, messages, tools):
        pass

    def decide(self, state):
        self.generated_tokens += 5
        if self.script:
            return self.script.pop(0)
        return Decision("act", {"command": state["expert_action"] or "look"})

    def observe(self, text):
        pass


def test_reward_is_won_minus_logged_cost_for_scripted_episode():
    game = list_games("valid_seen", limit=1)[0]
    env = ALFWorldEnv(game, max_steps=60)
    script = [Decision("recall", {"query": "find"}), Decision("commit", {"id": "g", "status": "active"}),
              Decision("commit", {"id": "g", "status": "bad"}),  # invalid: charged as a rejected turn, not a call
              Decision("track", {"entity": "x 1", "attribute": "location", "value": "desk 1"}),
              Decision(None, {}, malformed=True, text="lok"),  # malformed: rejected, though it still acts
              Decision("track", {"entity": "y 1", "attribute": "location", "value": "desk 1"})]  # over budget
    ws = Workspace(ExperienceStore(), "scripted")
    cost = CostConfig(per_call={"track": 0.1, "commit": 0.2, "recall": 0.3, "note": 0.4}, per_call_token=0.001,
                      per_generated_token=0.002, per_rejected_turn=0.05)
    res = run_episode(env, Scripted(script), ws, cost, max_env_steps=60, max_meta_actions=3)
    env.close()
    assert res.won
    assert res.meta_actions == {"track": 1, "commit": 1, "recall": 1, "note": 0}
    assert res.invalid_meta == 1 and res.malformed == 1 and res.rejected_turns == 3
    assert res.transcript[5]["result"].startswith("error: meta-action budget of 3 spent")
    turns = 6 + res.env_steps - 1 + 1  # scripted turns (malformed one acts) + expert acts + the final note turn
    assert res.generated_tokens == 5 * turns
    expected = 0.1 + 0.2 + 0.3 + 0.001 * ws.usage.call_tokens + 0.002 * res.generated_tokens + 0.05 * 3
    assert res.cost == pytest.approx(expected)
    tok = ws.usage.call_tokens_by_type
    assert res.cost_by_type == pytest.approx({
        "track": 0.1 + 0.001 * tok["track"], "commit": 0.2 + 0.001 * tok["commit"],
        "recall": 0.3 + 0.001 * tok["recall"], "note": 0.0})
    assert res.reward == pytest.approx(1.0 - expected)
    assert res.transcript[4]["generated"] == "lok" and res.transcript[4]["command"] == "look"


def test_a_meta_action_on_the_closing_turn_is_charged_as_rejected():
    """After the game ends only a `note` runs; a `track` there is an attempted call that is not executed."""

    class Flagged:  # the game, telling the policy when it is over
        def __init__(self, env):
            self.env, self.done = env, False

        def reset(self, seed=0):
            return self.env.reset(seed=seed)

        def step(self, action):
            res = self.env.step(action)
            self.done = res.done
            return res

    class TrackAtTheEnd(Scripted):
        def decide(self, state):
            if env.done:
                return Decision("track", {"entity": "x 1", "attribute": "location", "value": "desk 1"})
            return Decision("act", {"command": state["expert_action"] or "look"})

    env = Flagged(ALFWorldEnv(list_games("valid_seen", limit=1)[0], max_steps=60))
    ws = Workspace(ExperienceStore(), "closing")
    cost = CostConfig(per_generated_token=0.0, per_rejected_turn=0.05)
    res = run_episode(env, TrackAtTheEnd([]), ws, cost, max_env_steps=60)
    env.env.close()
    assert res.won and res.meta_actions["track"] == 0 and res.rejected_turns == 1
    assert res.cost == pytest.approx(0.05)


class Crashing:
    game, task_type = "crash", "pick_and_place_simple"

    def reset(self, seed=0):
        return StepResult("You are in a room.\n\nYour task is to: crash.", 0.0, False, False, ["look"], "look")

    def step(self, action):
        raise RuntimeError("engine died")


def test_crashed_environment_ends_episode_as_failed():
    res = run_episode(Crashing(), Scripted([]), Workspace(ExperienceStore()), CostConfig())
    assert not res.won and "engine died" in res.error and res.env_steps == 0


class Hanging(Crashing):
    def step(self, action):
        import time

        time.sleep(30)


def test_hanging_environment_times_out_and_ends_the_episode():
    import time

    t0 = time.time()
    res = run_episode(Hanging(), Scripted([]), Workspace(ExperienceStore()), CostConfig(), env_timeout_s=1.0)
    assert time.time() - t0 < 10
    assert not res.won and "did not return within 1.0s" in res.error


def test_meta_action_budget_refuses_extra_calls_and_turns_are_bounded():
    script = [Decision("recall", {"query": "x"})] * 50
    res = run_episode(Crashing(), Scripted(script), Workspace(ExperienceStore()), CostConfig(), max_env_steps=3,
                      max_meta_actions=2)
    assert res.meta_actions["recall"] == 2
    assert res.error == "turn budget spent" and len(res.transcript) == 3 + 2 + 2  # budgets + the note turn + 1
    assert res.transcript[2]["result"].startswith("error: meta-action budget of 2 spent")


class Tracker(Scripted):
    """Random moves, with a `track` of every object in every observation (a harness that logs everything)."""

    def __init__(self):
        import random

        super().__init__([])
        self.pending, self.rng = [], random.Random(0)

    def decide(self, state):
        self.generated_tokens += 5
        if self.pending:
            return self.pending.pop()
        moves = [c for c in state["admissible_commands"] if c.startswith(("go to", "open"))]
        return Decision("act", {"command": self.rng.choice(moves or ["look"])})

    def observe(self, text):
        import re

        if text.startswith(("ok:", "error:")):
            return
        for i, obj in enumerate(re.findall(r"\b([a-z]+ \d+)", text)):
            self.pending.append(Decision("track", {"entity": obj, "attribute": "seen", "value": f"turn {i}"}))


def test_workspace_stays_within_budget_over_a_50_step_episode():
    game = list_games("valid_seen", limit=1, offset=100)[0]
    env = ALFWorldEnv(game, max_steps=51)
    ws = Workspace(ExperienceStore(), "long", render_budget_tokens=160)
    res = run_episode(env, Tracker(), ws, CostConfig(), max_env_steps=50, max_meta_actions=400)
    env.close()
    assert res.env_steps == 50 and res.meta_actions["track"] > 50
    assert len(res.workspace_tokens) == len(res.transcript) and max(res.workspace_tokens) <= 160
    assert len(ws.belief) > 12  # Belief holds everything; the rendering keeps the newest within budget


def test_transcript_table_command(tmp_path, capsys):
    import json

    from evoharness.evaluation.transcript import main

    res = run_episode(Crashing(), Scripted([Decision("commit", {"id": "g", "status": "active"})]),
                      Workspace(ExperienceStore()), CostConfig())
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(res.__dict__) + "\n")
    main([str(path)])
    out = capsys.readouterr().out
    assert "game crash  won=False" in out and "commit" in out and "ok: g active" in out
    assert "error: env.step('look') failed" in out
    with pytest.raises(SystemExit, match="holds 1 episodes"):
        main([str(path), "--episode", "3"])


def test_unknown_tool_is_an_error_result_not_an_action():
    script = [Decision("search", {"q": "x"})]
    res = run_episode(Crashing(), Scripted(script), Workspace(ExperienceStore()), CostConfig(), max_env_steps=1)
    assert res.malformed == 1 and res.transcript[0]["result"].startswith("error: unknown tool 'search'")
    assert "engine died" in res.error  # the next turn acted, and the crashing environment ended the episode
