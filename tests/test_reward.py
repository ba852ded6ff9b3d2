"""The two reward conventions (``evoharness.training.reward``): each term of the paper's budget reward against a value
computed
by hand for a scripted episode, the diversity weight's anneal, the shared interaction budget in the policy loop, and
``priced`` mode giving today's ``won - cost``. No model and no ALFWorld: a three-command room plays the episodes."""

import dataclasses

import pytest

from evoharness.config import CostConfig, TraceConfig, load_profile
from evoharness.env.alfworld import StepResult
from evoharness.harness.context import turn_view
from evoharness.harness.workspace import ExperienceStore, Workspace
from evoharness.policy.agent import Decision, run_episode
from evoharness.training.reward import (
    Interaction,
    action_key,
    count_repeats,
    episode_budgets,
    lambda_div,
    reward_parts,
    types_share,
)
from evoharness.training.rollouts import episode_metrics

TASK = "You are in a room.\n\nYour task is to: win."
ADMISSIBLE = ["look", "go to desk 1", "win now"]


class Room:
    """A game won by the command ``win now``; every other admissible command just reports itself."""

    game, task_type = "room", "pick_and_place_simple"

    def reset(self, seed=0):
        return StepResult(TASK, 0.0, False, False, ADMISSIBLE, "win now")

    def step(self, action):
        won = action == "win now"
        return StepResult("You won." if won else f"You {action}.", float(won), won, won, ADMISSIBLE, "win now")


class Scripted:
    """Plays a fixed list of decisions (then ``look``), 5 generated tokens a turn; keeps every state it was shown."""

    def __init__(self, script):
        self.script, self.generated_tokens, self.states = list(script), 0, []

    def start(self, messages, tools):
        pass

    def decide(self, state):
        self.states.append(state)
        self.generated_tokens += 5
        return self.script.pop(0) if self.script else Decision("act", {"command": "look"})

    def observe(self, text):
        pass


COMMIT = {"id": "g", "status": "active"}
# 10 turns and the closing note. Calls: 5 environment actions, 6 others (recall, commit, commit, an invalid commit,
# an unknown tool, the closing note). Repeats S = 2 (the second commit, the second look). Invalid I = 4: the invalid
# commit, the unknown tool, the malformed turn (rejected, though it still acts) and the inadmissible "go to dsk 1".
SCRIPT = [Decision("recall", {"query": "win"}), Decision("commit", COMMIT), Decision("commit", COMMIT),
          Decision("commit", {"id": "g", "status": "bad"}), Decision("search", {"q": "x"}),
          Decision("act", {"command": "look"}), Decision("act", {"command": "look"}),
          Decision("act", {"command": "go to dsk 1"}), Decision(None, {}, malformed=True, text="look"),
          Decision("act", {"command": "win now"}), Decision("note", {"lesson": "win now wins"})]


def play(cost, script=SCRIPT, **kwargs):
    ws = Workspace(ExperienceStore(), "scripted")
    policy = Scripted(script)
    return run_episode(Room(), policy, ws, cost, max_env_steps=kwargs.pop("max_env_steps", 20),
                       max_meta_actions=kwargs.pop("max_meta_actions", 10), **kwargs), ws, policy


def test_the_scripted_episode_counts_what_the_budget_reward_reads():
    res, ws, _ = play(CostConfig())
    assert res.won and res.env_steps == 5 and res.meta_calls == 6
    assert res.meta_actions == {"track": 0, "commit": 2, "recall": 1, "note": 1}
    assert res.repeats == 2 and res.rejected_turns == 3 and res.invalid_actions == 4
    assert [e.get("command") for e in res.transcript if e["turn"] == "act"] == [
        "look", "look", "go to desk 1", "look", "win now"]


def test_each_budget_term_equals_its_hand_computed_value():
    cost = CostConfig(mode="budget", task_reward=10.0, interaction_budget=20, lambda_eff=2.0, lambda_div0=0.8,
                      anneal_updates=10, lambda_spam=0.3, spam_cap=1, lambda_inv=0.05)
    res, ws, _ = play(cost, update=5)
    parts = res.reward_parts
    assert parts["task"] == pytest.approx(10.0)                     # task_reward * 1[won]
    assert parts["efficiency"] == pytest.approx(2.0 * (20 - 11) / 20)  # |tau| = 5 env + 6 other calls = 11
    assert parts["lambda_div"] == pytest.approx(0.4)                # 0.8 * (1 + cos(pi/2)) / 2 at u = U/2
    assert parts["diversity"] == pytest.approx(0.4 * 0.75)          # recall, commit, note: 3 of 4 types
    assert parts["spam"] == pytest.approx(-0.3 * 1)                 # S = 2, capped at C_spam = 1
    assert parts["invalid"] == pytest.approx(-0.05 * 4)             # I = 4
    assert parts["cost"] == 0.0                                     # the priced cost is not charged ...
    assert parts["priced_cost"] == pytest.approx(ws.usage.cost(cost)) and parts["priced_cost"] > 0  # ... but kept
    assert res.cost == pytest.approx(parts["priced_cost"])
    assert res.reward == pytest.approx(10.0 + 0.9 + 0.3 - 0.3 - 0.2)
    assert res.reward == pytest.approx(sum(parts[k] for k in ("task", "efficiency", "diversity", "spam", "invalid")))


def test_paper_defaults_on_the_scripted_episode():
    cost = CostConfig(mode="budget")  # T_max 70, lambda_eff 1, lambda_div0 1 over U = 150, spam 0.1 (cap 10), inv 0.1
    res, _, _ = play(cost, update=0)
    assert res.reward == pytest.approx(10.0 + (70 - 11) / 70 + 1.0 * 0.75 - 0.1 * 2 - 0.1 * 4)
    res, _, _ = play(cost)  # outside training (evaluation): no update, no diversity bonus
    assert res.reward_parts["lambda_div"] == 0.0 and res.reward_parts["diversity"] == 0.0


def test_budget_mode_can_charge_the_priced_cost_on_top():
    """``charge_priced``: the paper's reward less the priced cost (executed calls at their ``per_call`` price, the
    generated tokens, the rejected turns), every other term unchanged."""
    cost = CostConfig(mode="budget", charge_priced=True, per_call={"track": 0.1, "commit": 0.2, "recall": 0.3,
                      "note": 0.4}, per_call_token=0.0, per_generated_token=0.002, per_rejected_turn=0.05)
    res, _, _ = play(cost, update=0)
    priced = 0.2 * 2 + 0.3 + 0.4 + 0.002 * 5 * 11 + 0.05 * 3  # commit x2, recall, note; 11 turns x 5 tokens; 3 rejected
    assert res.reward_parts["cost"] == pytest.approx(-priced)
    assert res.reward_parts["priced_cost"] == pytest.approx(priced)
    paper = 10.0 + (70 - 11) / 70 + 1.0 * 0.75 - 0.1 * 2 - 0.1 * 4
    assert res.reward == pytest.approx(paper - priced)
    uncharged = play(dataclasses.replace(cost, charge_priced=False), update=0)[0]
    assert uncharged.reward == pytest.approx(paper) and uncharged.reward_parts["cost"] == 0.0


def test_lambda_div_anneals_by_cosine_from_lambda_div0_to_zero():
    cost = CostConfig(mode="budget", lambda_div0=0.8, anneal_updates=150)
    assert lambda_div(0, cost) == pytest.approx(0.8)
    assert lambda_div(75, cost) == pytest.approx(0.4)
    assert lambda_div(150, cost) == pytest.approx(0.0, abs=1e-12)
    assert lambda_div(30, cost) == pytest.approx(0.8 * (1 + 0.8090169943749475) / 2)  # cos(pi / 5)
    assert lambda_div(400, cost) == pytest.approx(0.0, abs=1e-12) and lambda_div(-3, cost) == pytest.approx(0.8)
    assert lambda_div(None, cost) == 0.0


def test_priced_mode_is_todays_reward_exactly():
    cost = CostConfig(per_call={"track": 0.1, "commit": 0.2, "recall": 0.3, "note": 0.4}, per_call_token=0.001,
                      per_generated_token=0.002, per_rejected_turn=0.05)
    assert cost.mode == "priced"
    res, ws, policy = play(cost, update=7)
    today = float(res.won) - ws.usage.cost(cost)  # the reward before cost.mode existed
    assert res.reward == today  # bit for bit, not approximately
    hand = 1.0 - (0.2 * 2 + 0.3 + 0.4 + 0.001 * ws.usage.call_tokens + 0.002 * 5 * 11 + 0.05 * 3)
    assert res.reward == pytest.approx(hand)
    assert res.reward_parts == {"task": 1.0, "efficiency": 0.0, "diversity": 0.0, "lambda_div": 0.0, "spam": 0.0,
                                "invalid": 0.0, "cost": -res.cost, "priced_cost": res.cost, "total": res.reward}
    # the budget weights do not touch the priced reward, and neither does the shared budget's absence
    weights = dataclasses.replace(cost, lambda_eff=5.0, lambda_div0=3.0, lambda_inv=1.0, task_reward=2.0)
    assert play(weights, update=7)[0].reward == res.reward


def test_reward_parts_floors_efficiency_caps_spam_and_can_leave_meta_actions_uncharged():
    cost = CostConfig(mode="budget", interaction_budget=10, spam_cap=3, lambda_spam=0.5, lambda_div0=0.0)
    long = Interaction(won=True, env_steps=8, meta_calls=4, meta_actions={"track": 2}, repeats=7, invalid=0)
    parts = reward_parts(long, 0.25, cost, update=0)
    assert parts.efficiency == 0.0 and parts.spam == pytest.approx(-1.5) and parts.priced_cost == 0.25
    assert parts.total == pytest.approx(10.0 - 1.5)
    free = dataclasses.replace(cost, charge_meta_actions=False)  # only environment actions spend the budget
    assert reward_parts(long, 0.25, free, update=0).efficiency == pytest.approx((10 - 8) / 10)
    lost = dataclasses.replace(long, won=False)
    assert reward_parts(lost, 0.25, free, update=0).efficiency == 0.0
    assert reward_parts(lost, 0.25, free, update=0).task == 0.0


def test_diversity_share_repeats_and_action_keys():
    used = [{}, {"track": 3}, {"track": 1, "note": 1}, {"track": 1, "note": 1, "recall": 2},
            {"track": 1, "commit": 1, "recall": 1, "note": 1}]
    assert [types_share(c) for c in used] == [0, .25, .5, .75, 1]
    assert types_share({"track": 0, "commit": 0}) == 0
    assert count_repeats(["a", "a", "a", "b", "a", "a"]) == 3 and count_repeats([]) == 0
    assert action_key({"turn": "act", "command": "Go  to desk 1"}) == "go to desk 1"
    one = action_key({"turn": "track", "args": {"entity": "pen 1", "attribute": "location", "value": "desk 1"}})
    assert one == action_key({"turn": "track", "args": {"value": "desk 1", "attribute": "location", "entity": "pen 1"}})
    assert one != action_key({"turn": "commit", "args": {"entity": "pen 1", "attribute": "location",
                                                          "value": "desk 1"}})


def test_budget_mode_meta_actions_spend_the_shared_budget():
    cost = CostConfig(mode="budget", interaction_budget=4)
    meta, look, note = [Decision("recall", {"query": "x"}), Decision("commit", COMMIT)], \
        Decision("act", {"command": "look"}), Decision("note", {"lesson": "l"})
    res, _, _ = play(cost, meta + [look] * 2 + [note], interaction_budget=4)
    assert not res.won and res.env_steps == 2  # recall, commit, look, look: 4 units, then the closing note
    assert res.meta_calls == 3 and res.transcript[-1]["turn"] == "note" and len(res.transcript) == 5
    assert res.error is None and res.reward_parts["efficiency"] == 0.0
    # without the shared budget the meta-actions do not count against the environment steps
    free, _, _ = play(cost, meta + [look] * 4 + [note], max_env_steps=4)
    assert free.env_steps == 4 and free.meta_calls == 3 and free.transcript[-1]["turn"] == "note"


def test_budget_spent_inside_a_turn_drops_the_rest_of_it_and_the_closing_prompt_says_so():
    cost = CostConfig(mode="budget", interaction_budget=2)
    track = ("track", {"entity": "a 1", "attribute": "state", "value": "x"})
    turn = Decision("act", {"command": "win now"}, before=[("recall", {"query": "x"}), ("commit", COMMIT), track])
    ws = Workspace(ExperienceStore(), "parallel")
    policy = Scripted([turn, Decision("note", {"lesson": "l"})])
    res = run_episode(Room(), policy, ws, cost, max_env_steps=5, max_meta_actions=5,
                      view=turn_view(TraceConfig(context="turn")), interaction_budget=2)
    assert not res.won and res.env_steps == 0  # the act after the budget ran out never ran
    assert [e["turn"] for e in res.transcript] == ["recall", "commit", "note"] and res.meta_actions["track"] == 0
    assert policy.states[-1]["closing"] and "The episode is over." in policy.states[-1]["observation"]


def test_training_budgets_per_mode():
    assert episode_budgets(CostConfig(), 50, 30) == (50, 30, None)
    assert episode_budgets(CostConfig(mode="budget"), 50, 30) == (70, 70, 70)
    assert episode_budgets(CostConfig(mode="budget", charge_meta_actions=False), 50, 30) == (70, 30, None)


def test_step_metrics_log_every_term_and_they_sum_to_the_reward():
    cost = CostConfig(mode="budget", interaction_budget=20, anneal_updates=10)
    won, _, _ = play(cost, update=5)
    lost, _, _ = play(cost, [Decision("track", {"entity": "a 1", "attribute": "state", "value": "x"})],
                      max_env_steps=3, update=5)
    m = episode_metrics([won, lost])
    assert m["reward_task"] == pytest.approx(5.0) and m["lambda_div"] == pytest.approx(0.5)
    assert m["reward_eff"] == pytest.approx((20 - 11) / 20 / 2)
    assert m["reward_spam"] == pytest.approx(-0.1 * (2 + 2) / 2)  # the lost episode looks 3 times: 2 repeats
    assert m["reward_inv"] == pytest.approx(-0.1 * 4 / 2) and m["reward_cost"] == 0.0
    terms = ("reward_task", "reward_eff", "reward_div", "reward_spam", "reward_inv", "reward_cost")
    assert sum(m[k] for k in terms) == pytest.approx(m["reward"])
    assert m["cost"] == pytest.approx((won.cost + lost.cost) / 2) and m["cost"] > 0  # priced, logged, not charged
    assert (m["meta_calls"], m["repeats"], m["invalid_actions"]) == (pytest.approx(3.5), 2.0, 2.0)


def test_cost_mode_is_validated_and_the_budget_profile_loads():
    with pytest.raises(ValueError, match="cost.mode is 'paper'"):
        CostConfig(mode="paper")
    with pytest.raises(ValueError, match="anneal_updates"):
        CostConfig(anneal_updates=0)
    cfg = load_profile("grpo-budget")
    assert cfg.cost.mode == "budget" and cfg.traces.parallel_calls  # the full recipe underneath
    assert (cfg.cost.interaction_budget, cfg.cost.task_reward, cfg.cost.lambda_inv) == (70, 10.0, 0.1)
    assert cfg.evaluate.max_env_steps == 50  # evaluation keeps ALFWorld's limit
    assert load_profile("full").cost.mode == "priced"


def test_priced_evaluations_keep_their_identity_budget_ones_record_every_weight():
    """An evaluation folder written before the budget fields existed still resumes in priced mode; a budget-mode
    evaluation is told apart by its weights."""
    from evoharness.config import EvalConfig
    from evoharness.evaluation.evaluate import evaluation_identity

    priced = evaluation_identity("p", EvalConfig(), CostConfig(), None)["cost"]
    assert priced == {"per_call": {"track": 0.02, "commit": 0.02, "recall": 0.03, "note": 0.03},
                      "per_call_token": 0.0005, "per_generated_token": 0.0002, "per_rejected_turn": 0.03}
    budget = evaluation_identity("p", EvalConfig(), CostConfig(mode="budget"), None)["cost"]
    assert budget["mode"] == "budget" and budget["interaction_budget"] == 70
    other = evaluation_identity("p", EvalConfig(), dataclasses.replace(CostConfig(mode="budget"), lambda_eff=0.0),
                                None)["cost"]
    assert other != budget
