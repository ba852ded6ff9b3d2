"""The policy loop: harness + environment + policy, shared by GRPO rollouts and evaluation.

Each turn the policy calls one tool: ``act`` (an environment command, mapped to the closest admissible command)
or a meta-action (``track``, ``commit``, ``recall``, ``note``) executed by the ``Workspace``. In the
``parallel_calls`` layout a turn may call meta-actions first, in the same message (``Decision.before``); they run
in order before the turn's last call. The episode ends when ALFWorld reports ``done`` (won, or out of steps), or
when the step or meta-action budget runs out (with ``cost.mode: budget`` in training, when environment actions and
meta-action calls together reach the shared interaction budget); the policy then gets one last turn in which only
``note`` is executed. An environment that raises ends the episode as failed with the reason recorded. The reward is
``evoharness.training.reward.reward_parts`` of the episode's counts.
"""

from __future__ import annotations

import difflib
import json
import random
import re
from dataclasses import dataclass, field

from evoharness.config import CostConfig
from evoharness.harness.context import TurnView
from evoharness.harness.workspace import META_ACTIONS, SYSTEM_PROMPT, TOOLS, Workspace, final_observation, tokens
from evoharness.training.reward import Interaction, action_key, count_repeats, reward_parts

_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
_BLOCK = re.compile(r"<tool_call>.*?</tool_call>", re.S)  # one block: never runs past its own closing tag


@dataclass
class Decision:
    """One policy turn: the tool name and arguments, plus what a language-model policy generated."""

    name: str | None
    args: dict
    malformed: bool = False
    text: str = ""
    before: list[tuple[str, dict]] = field(default_factory=list)  # calls of the same turn ahead of this one, in order
    appended: bool = False  # an act the decoder added after a generated turn of meta-actions only (act_each_turn)


def parse_tool_call(text: str) -> tuple[str | None, dict]:
    """Parse the first Qwen3 ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in ``text``.

    Returns (name, arguments) or (None, {}) when no well-formed call is present. Arguments given as a JSON
    string are decoded.
    """
    m = _TOOL_CALL.search(text)
    if not m:
        return None, {}
    try:
        call = json.loads(m.group(1))
        args = call.get("arguments", {})
        if isinstance(args, str):
            args = json.loads(args)
        name = call.get("name")
        return (name, args) if isinstance(name, str) and isinstance(args, dict) else (None, {})
    except (json.JSONDecodeError, AttributeError):
        return None, {}


def parse_tool_calls(text: str) -> list[tuple[str, dict]]:
    """Every well-formed ``<tool_call>`` block in ``text``, in order, as (name, arguments); ill-formed blocks are
    skipped (``parse_tool_call`` on each block). A turn in the ``parallel_calls`` layout holds several."""
    calls = []
    for m in _BLOCK.finditer(text):
        name, args = parse_tool_call(m.group(0))
        if name is not None:
            calls.append((name, args))
    return calls


def closest_admissible(command: str, admissible: list[str]) -> str:
    """The admissible command most similar to ``command`` (difflib ratio); exact matches are kept."""
    if command in admissible or not admissible:
        return command
    return max(admissible, key=lambda c: difflib.SequenceMatcher(None, command, c).ratio())


@dataclass
class EpisodeResult:
    """Outcome and accounting of one episode (``won`` is ALFWorld's flag, never ``done``)."""

    game: str
    task_type: str
    won: bool
    env_steps: int
    meta_actions: dict[str, int]
    generated_tokens: int
    cost: float
    reward: float
    malformed: int = 0
    remapped: int = 0
    invalid_meta: int = 0
    rejected_turns: int = 0
    error: str | None = None
    workspace_tokens: list[int] = field(default_factory=list)
    transcript: list[dict] = field(default_factory=list)
    cost_by_type: dict[str, float] = field(default_factory=dict)
    grounded_names: int | None = None  # track names scored over the observation's (ground_track); None: not recorded
    # what the budget reward counts (evoharness.training.reward), recorded in both modes:
    meta_calls: int = 0  # calls other than executed environment actions: meta-actions (run, invalid or refused),
    # unknown tools, misplaced acts, the closing turn's calls; |tau| = env_steps + meta_calls when they are charged
    repeats: int = 0  # S: calls identical to the call before them
    invalid_actions: int = 0  # I: rejected turns + well-formed acts of an inadmissible command
    reward_parts: dict[str, float] = field(default_factory=dict)  # evoharness.training.reward.RewardParts of ``reward``


class ExpertPolicy:
    """ALFWorld's handcoded expert: plays ``expert_action`` (no meta-actions)."""

    def start(self, messages, tools):
        pass

    def decide(self, state: dict) -> Decision:
        return Decision("act", {"command": state.get("expert_action") or "look"})

    def observe(self, text: str):
        pass


class RandomPolicy:
    """A uniformly random admissible command each step (seeded)."""

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    def start(self, messages, tools):
        pass

    def decide(self, state: dict) -> Decision:
        return Decision("act", {"command": self.rng.choice(state["admissible_commands"] or ["look"])})

    def observe(self, text: str):
        pass


def run_episode(env, policy, workspace: Workspace, cost_cfg: CostConfig, max_env_steps: int = 40,
                max_meta_actions: int = 20, seed: int = 0, env_timeout_s: float = 60.0,
                view: TurnView | None = None, interaction_budget: int | None = None,
                update: int | None = None) -> EpisodeResult:
    """Play one episode of ``env`` (an adapter with ``reset``/``step``) with ``policy`` and ``workspace``.

    Budgets: ``max_env_steps`` environment steps; ``max_meta_actions`` executed meta-actions (later ones are refused
    with an error result; invalid calls and unknown tools get an error result and count as malformed); at most
    ``max_env_steps + max_meta_actions + 2`` turns in all (room for refused calls and the last note). Each
    environment call gets ``env_timeout_s`` seconds; one that raises or hangs ends the episode unwon with ``error`` set.
    ``interaction_budget`` (``cost.mode: budget`` in training, ``evoharness.training.reward.episode_budgets``):
    environment actions and every other call (``EpisodeResult.meta_calls``) spend one unit each, a turn of several calls
    one per call; once they reach the budget the episode ends unwon, the rest of that turn's calls are dropped
    unexecuted, and the closing turn follows. None (evaluation, ``priced`` mode): no shared budget.

    The reward is ``evoharness.training.reward.reward_parts`` under ``cost_cfg.mode``, at GRPO step ``update`` (None
    outside training); its terms are kept in ``EpisodeResult.reward_parts``. ``priced`` mode (the default):
    reward = won - cost (``EpisodeUsage.cost``): the cost charges *executed* meta-actions at their ``per_call`` price,
    every generated token, and every *rejected* turn at ``per_rejected_turn`` (a malformed turn, even one score
    decoding still plays as an act; an unknown tool; a meta-action whose arguments fail its schema or that is refused
    over ``max_meta_actions``; on the closing turn, any call but ``note``). So an attempted call always costs:
    executed at its type's price, rejected at the rejection price. The closing ``note`` runs even when the budget is
    spent.

    The transcript holds one entry per call (a turn with ``Decision.before`` gives one per call, the turn's generated
    tokens on its first): the tool and arguments, the result, the call's cost in reward units, and the rendered
    workspace after it.

    ``view``: the ``turn`` context (``evoharness.harness.context.TurnView``); each turn's prompt is then passed to the
    policy as ``state["turn_messages"]`` (with the latest environment observation as ``state["observation"]``), and
    ``state["force_act"]`` is set when the prompt is the previous turn's (a repeated
    call that changed nothing: a deterministic policy would loop). Without harness (the plain baseline) the episode
    ends with its last command: there is no closing note turn.
    """
    from evoharness.env.timeouts import call_with_timeout

    transcript: list[dict] = []
    ws_tokens: list[int] = []
    malformed = remapped = env_steps = meta = 0
    meta_calls = inadmissible = 0  # calls that are not environment actions; well-formed acts of inadmissible commands

    def budget_spent() -> bool:  # the shared budget of environment actions and meta-action calls (budget mode)
        return interaction_budget is not None and env_steps + meta_calls >= interaction_budget

    grounded_before = getattr(policy, "grounded", 0)  # every turn's, the closing one's included
    won, error = False, None
    try:
        res = call_with_timeout(env.reset, env_timeout_s, seed=seed)
    except Exception as exc:
        return _result(env, workspace, cost_cfg, False, 0, 0, 0, f"reset failed: {exc!r}", [], [])
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": res.observation}]
    workspace.observe(0, res.observation)
    if view is not None:
        view.start(res.observation)
    policy.start(messages, TOOLS)
    finished = False
    previous_prompt = None
    for _turn in range(max_env_steps + max_meta_actions + 2):
        prompt = view.prompt(workspace.render()) if view is not None else None
        state = {"admissible_commands": res.admissible_commands, "expert_action": res.expert_action,
                 "turn_messages": prompt,
                 "observation": view.observation if view is not None else res.observation,  # the latest one
                 # a turn that left the prompt as it was would be answered the same way again: act instead
                 "force_act": prompt is not None and prompt == previous_prompt and not finished,
                 "closing": finished}  # the last turn: only a note runs
        previous_prompt = prompt
        cost_before = workspace.usage.cost(cost_cfg)
        tokens_before = getattr(policy, "generated_tokens", 0)
        dec = policy.decide(state)
        workspace.usage.generated_tokens = getattr(policy, "generated_tokens", 0)
        if getattr(policy, "truncated", False):
            if not finished:  # a full context on the last (note) turn does not spoil a finished episode
                error = "context window full: episode truncated"
            break
        malformed += dec.malformed
        workspace.usage.rejected_turns += dec.malformed
        turn_tokens = workspace.usage.generated_tokens - tokens_before
        calls = dec.before + [(dec.name, dec.args)]
        if finished:  # the last turn: only a note is executed
            for name, args in calls:
                meta_calls += name not in (None, "act")  # the closing calls spend the budget too (|tau| may pass it)
                if name == "note" and (view is None or view.harness):  # also past the meta-action budget
                    entry = {"turn": name, "args": args, "generated_tokens": turn_tokens}
                    entry["result"], entry["ok"] = workspace.call("note", args, env_steps)
                    workspace.usage.rejected_turns += not entry["ok"]
                    transcript.append(_close(entry, workspace, cost_cfg, cost_before))
                    turn_tokens, cost_before = 0, workspace.usage.cost(cost_cfg)
                elif name not in (None, "act"):  # another meta-action or an unknown tool: attempted, not executed
                    workspace.usage.rejected_turns += 1
            break
        for name, args in dec.before:  # parallel_calls: the turn's meta-actions ahead of its last call
            if finished:  # the shared budget ran out on an earlier call of this turn: the rest is dropped
                break
            entry = {"turn": name, "args": args, "generated_tokens": turn_tokens}
            meta_calls += 1
            if name in META_ACTIONS:
                meta += _meta_call(workspace, view, entry, meta, max_meta_actions, env_steps)
            else:  # an act ahead of another call, or an unknown tool: only a turn's last call may act
                malformed += 1
                _reject(workspace, view, entry, f"error: {name!r} is not a meta-action; act must be a turn's last call")
            transcript.append(_close(entry, workspace, cost_cfg, cost_before))
            ws_tokens.append(len(tokens(entry["workspace"])))
            turn_tokens, cost_before = 0, workspace.usage.cost(cost_cfg)
            finished = budget_spent()
        if finished:  # budget spent by the turn's meta-actions: its last call is dropped, the closing turn is next
            _over_budget(view)
            policy.observe(final_observation(transcript[-1]["result"], False))
            continue
        entry = {"turn": dec.name or "malformed", "args": dec.args, "generated_tokens": turn_tokens}
        if dec.name in META_ACTIONS:
            meta_calls += 1
            meta += _meta_call(workspace, view, entry, meta, max_meta_actions, env_steps)
            finished = _over_budget(view) if budget_spent() else False
        elif dec.name not in (None, "act"):
            meta_calls += 1
            malformed += 1
            _reject(workspace, view, entry,
                    f"error: unknown tool {dec.name!r}; call act or one of {list(META_ACTIONS)}")
            finished = _over_budget(view) if budget_spent() else False
        else:
            command = str(dec.args.get("command", dec.text)) if dec.name == "act" else dec.text
            chosen = closest_admissible(command.strip(), res.admissible_commands)
            remapped += chosen != command.strip()
            # a well-formed act of a command that is not admissible: an invalid action (a malformed one is rejected)
            inadmissible += dec.name == "act" and not dec.malformed and chosen != command.strip()
            try:
                res = call_with_timeout(env.step, env_timeout_s, chosen)
            except Exception as exc:
                error = f"env.step({chosen!r}) failed: {exc!r}"
                break
            env_steps += 1
            text, won = res.observation, res.won
            workspace.observe(env_steps, text)
            entry.update(turn="act", command=chosen, generated=command, result=text, won=won)
            if dec.appended:
                entry["appended"] = True
            finished = res.done or env_steps >= max_env_steps or budget_spent()
            if view is not None:
                view.record_act(chosen, final_observation(text, won) if finished else text)
                if finished and not view.harness:
                    transcript.append(_close(entry, workspace, cost_cfg, cost_before))
                    ws_tokens.append(len(tokens(entry["workspace"])))
                    break  # the plain baseline has no closing note turn
        transcript.append(_close(entry, workspace, cost_cfg, cost_before))
        ws_tokens.append(len(tokens(entry["workspace"])))
        policy.observe(final_observation(entry["result"], won) if finished else entry["result"])
    else:
        if not finished:
            error = error or "turn budget spent"
    workspace.finish(won)
    return _result(env, workspace, cost_cfg, won, env_steps, malformed, remapped, error, ws_tokens, transcript,
                   getattr(policy, "grounded", 0) - grounded_before, meta_calls, inadmissible, update)


def _meta_call(workspace: Workspace, view: TurnView | None, entry: dict, executed: int, budget: int, step: int) -> int:
    """Execute the meta-action ``entry`` names unless ``executed`` has reached ``budget``; record its result in
    ``entry`` and the view. Returns 1 when it ran (the budget counts executed calls; invalid ones are bounded by the
    turn budget), else 0."""
    name, args = entry["turn"], entry["args"]
    if executed < budget:
        text, ok = workspace.call(name, args, step)
    else:
        text, ok = f"error: meta-action budget of {budget} spent; act instead", False
    workspace.usage.rejected_turns += not ok
    entry.update(result=text, ok=ok)
    if view is not None:
        view.record_meta(name, text, ok)
    return int(ok and executed < budget)


def _over_budget(view: TurnView | None) -> bool:
    """The shared budget ran out on a call that was not an act: the closing turn's prompt says the episode is over
    (as an act's final observation does). Returns True (the episode is finished)."""
    if view is not None:
        view.observation = final_observation(view.observation, False)
    return True


def _reject(workspace: Workspace, view: TurnView | None, entry: dict, text: str) -> None:
    """A call that is neither an act nor a meta-action: rejected (it costs a rejected turn), its error recorded."""
    workspace.usage.rejected_turns += 1
    entry.update(result=text, ok=False)
    if view is not None:
        view.record_error(text)


def _close(entry: dict, workspace: Workspace, cost_cfg: CostConfig, cost_before: float) -> dict:
    entry["cost"] = workspace.usage.cost(cost_cfg) - cost_before
    entry["workspace"] = workspace.render()
    return entry


def _result(env, ws, cost_cfg, won, env_steps, malformed, remapped, error, ws_tokens, transcript, grounded_names=0,
            meta_calls=0, inadmissible=0, update=None):
    cost = ws.usage.cost(cost_cfg)
    counts = Interaction(won=won, env_steps=env_steps, meta_calls=meta_calls, meta_actions=dict(ws.usage.calls),
                         repeats=count_repeats([action_key(e) for e in transcript]),
                         invalid=ws.usage.rejected_turns + inadmissible)
    parts = reward_parts(counts, cost, cost_cfg, update)  # priced mode: exactly float(won) - cost
    return EpisodeResult(
        game=getattr(env, "game", ""), task_type=getattr(env, "task_type", ""), won=won, env_steps=env_steps,
        meta_actions=dict(ws.usage.calls), generated_tokens=ws.usage.generated_tokens, cost=cost,
        reward=parts.total, malformed=malformed, remapped=remapped, invalid_meta=ws.usage.invalid_calls,
        rejected_turns=ws.usage.rejected_turns,
        error=error, workspace_tokens=ws_tokens, transcript=transcript,
        cost_by_type=ws.usage.cost_by_type(cost_cfg), grounded_names=grounded_names, meta_calls=meta_calls,
        repeats=counts.repeats, invalid_actions=counts.invalid, reward_parts=parts.as_dict())
