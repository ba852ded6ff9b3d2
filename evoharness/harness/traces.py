"""BPE trace construction: raw episodes -> chat conversations with meta-actions where a teacher would call them.

The teacher reads an episode's raw steps and inserts, in the Qwen3 tool-call chat format the model trains on:
- ``recall`` at task start (query: the task object), and again after two failed commands in a row
  ("Nothing happens.");
- ``commit`` of each subgoal, by id with its dependency, when the observation shows it completed;
- ``track`` when an observation reveals where a task object is, or that it was picked up, cleaned, heated,
  cooled or placed, and (unless ``TraceConfig.track_searched`` is off) when it shows a receptacle's contents without
  a task object (``searched``), so the search does not go back to it;
- ``note`` at episode end, with a lesson (where the object was found; which command form failed).

In the ``turn`` context each tool call is its own example, or with ``TraceConfig.parallel_calls`` each environment
step is one: the meta-actions the teacher calls on an observation and the next act, as one assistant message with
several tool calls, read from the prompt before those meta-actions ran (and the closing note alone). The calls and
their order are the same in both layouts.

DAgger episodes (``evoharness.data.dagger``: the policy acted, the expert labelled each state) give ``turn`` examples
whose act targets are the expert's commands, with the policy's own commands as history.

Every meta-action runs against a real ``Workspace`` so its tool result is what the policy will see at run time.
Experience comes only from episodes earlier in the (sorted) episode order, so a trace never sees its own future.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from pathlib import Path

from evoharness.config import TraceConfig
from evoharness.data.records import Episode
from evoharness.env.alfworld import task_params_from_path
from evoharness.harness.context import TurnView
from evoharness.harness.workspace import (
    NOTHING,
    SYSTEM_PROMPT,
    TOOLS,
    ExperienceStore,
    Workspace,
    final_observation,
    tokens,
)

_EFFECTS = {"clean": "clean", "heat": "hot", "cool": "cool"}


def tool_call_message(name: str, args: dict) -> dict:
    """An assistant message with one tool call; arguments as a JSON string (Arrow would merge dicts)."""
    return tool_calls_message([(name, args)])


def tool_calls_message(calls: list[tuple[str, dict]]) -> dict:
    """An assistant message with the tool calls ``[(name, args), ...]`` in order (Qwen3's chat template renders each
    as its own ``<tool_call>`` block); arguments as JSON strings."""
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": n, "arguments": json.dumps(a)}} for n, a in calls]}


def subgoal_plan(game: str) -> list[tuple[str, str, str]]:
    """The teacher's subgoals for a game as (id, text, completion marker regex on the observation)."""
    p = task_params_from_path(game)
    obj = p["object_target"].lower()
    recep = (p["parent_target"] or p["toggle_target"]).lower()
    plan = [("find", f"find a {obj}", rf"\b{obj} \d+"), ("take", f"take a {obj}", rf"You pick up the {obj} \d+")]
    tt = p["task_type"]
    for verb in ("clean", "heat", "cool"):
        if verb in tt:
            plan.append((verb, f"{verb} the {obj}", rf"You {verb} the {obj} \d+"))
    if tt == "look_at_obj_in_light":
        plan.append(("light", f"use the {recep}", r"You turn on"))
    else:
        plan.append(("place", f"put the {obj} in/on {recep}", rf"You move the {obj} \d+ to"))
    if tt == "pick_two_obj_and_place":
        plan += [("take2", f"take a second {obj}", rf"You pick up the {obj} \d+"),
                 ("place2", f"put the second {obj} in/on {recep}", rf"You move the {obj} \d+ to")]
    return plan


def watched_objects(game: str) -> list[str]:
    """Object names whose sightings the teacher tracks: the task object, and for ``look_at_obj_in_light`` the lamp."""
    p = task_params_from_path(game)
    names = [p["object_target"].lower()]
    if p["task_type"] == "look_at_obj_in_light" and p["toggle_target"]:
        names.append(p["toggle_target"].lower())
    return names


def _seen_objects(observation: str, obj: str) -> list[tuple[str, str]]:
    """(object id, receptacle) pairs for ``obj`` seen in "On the X, you see ..." / "In it, you see ..." text."""
    m = re.search(r"(?:arrive at|open the) ([a-z]+ \d+)", observation)
    where = m.group(1) if m else None
    if where is None:
        return []
    return [(o, where) for o in re.findall(rf"\b({obj} \d+)", observation)]


def _contents_shown(observation: str) -> str | None:
    """The receptacle whose contents the observation lists ("On the X, you see ..." / "In it, you see ..."), or None
    (e.g. "The drawer 3 is closed.")."""
    m = re.search(r"(?:arrive at|open the) ([a-z]+ \d+)", observation)
    return m.group(1) if m and "you see" in observation else None


class Teacher:
    """Annotates episodes with meta-actions, in order, over one Experience store (see module docstring)."""

    def __init__(self, cfg: TraceConfig, experience: ExperienceStore | None = None):
        self.cfg = cfg
        self.experience = experience or ExperienceStore()

    def annotate(self, ep: Episode) -> dict:
        """One episode -> a trace row ``{"messages", "tools", "turns", "episode_id", "game", "won", "meta_actions",
        "workspace"}``. ``messages`` is the whole episode as one conversation (``history`` context); ``turns`` holds
        one prompt/completion example per policy turn (``turn`` context, see ``evoharness.harness.context``), leaving
        out the commands that are never targets (``TraceConfig.drop_labels``). Non-ALFWorld episodes (generic logs) get
        the task-level meta-actions only: recall, the goal commit and the closing note."""
        cfg = self.cfg
        ws = Workspace.from_config(self.experience, ep.episode_id, cfg)
        msgs: list[dict] = [{"role": "system", "content": SYSTEM_PROMPT},
                            {"role": "user", "content": ep.records[0]["observation"]}]
        view = TurnView(ep.task, cfg.harness, cfg.recent_actions, cfg.system_prompt, cfg.lesson_turns)
        view.start(ep.records[0]["observation"])
        turns: list[dict] = []
        # parallel_calls: the meta-actions called since the last command, and the prompt their turn was read from
        pending: list[tuple[str, dict]] = []
        turn_prompt = view.prompt(ws.render()) if cfg.parallel_calls else None
        # A string seed: the same draws on every machine and under every PYTHONHASHSEED.
        dropout = random.Random(f"call_dropout {ep.episode_id}") if cfg.call_dropout else None

        def dropped(name: str) -> bool:
            share = cfg.call_dropout.get(name, 0.0)
            return share > 0 and dropout.random() < share

        def example(call: dict) -> None:
            turns.append({"prompt": view.prompt(ws.render()), "completion": [call]})

        def turn(act: tuple[str, dict] | None) -> None:
            """parallel_calls: one example of the pending meta-actions then ``act`` (if any), from ``turn_prompt``."""
            calls = pending + ([act] if act else [])
            if calls:
                turns.append({"prompt": turn_prompt, "completion": [tool_calls_message(calls)]})
            pending.clear()

        def meta(name: str, args: dict, step: int) -> None:
            if not cfg.harness:  # the plain baseline: no meta-action anywhere, nothing in Experience
                return
            call = tool_call_message(name, args)
            if cfg.parallel_calls:
                pending.append((name, args))
            else:
                example(call)
            result, ok = ws.call(name, args, step)
            msgs.extend([call, {"role": "tool", "content": result}])
            view.record_meta(name, result, ok)

        def track(entity: str, attribute: str, value: str, step: int) -> None:
            """Track a fact unless Belief already holds exactly it (a repeated call would change nothing)."""
            fact = ws.belief.get((entity, attribute))
            if (fact is None or fact.value != value) and not dropped("track"):
                meta("track", {"entity": entity, "attribute": attribute, "value": value}, step)

        try:
            obj = task_params_from_path(ep.game)["object_target"].lower()
            plan, watched = subgoal_plan(ep.game), watched_objects(ep.game)
        except ValueError:  # not an ALFWorld game path: a generic tool-using agent's episode
            obj, plan, watched = None, [], []
        # Short arguments: the task is in every prompt, so the teacher never makes the policy copy it.
        meta("recall", {"query": obj or ep.task or ep.task_type}, 0)
        if obj is None:  # a generic episode has no subgoal plan: its goal is the only Progress entry
            meta("commit", {"id": "goal", "status": "active", "text": ep.task}, 0)
        next_goal, failures, found_at, last_committed = 0, 0, None, None
        ws.observe(0, ep.records[0]["observation"])
        admissible = ep.records[0]["admissible_commands"]  # the commands the state before each record admits
        for rec in ep.records[1:]:
            obs, step = rec["observation"], rec["step"]
            call = tool_call_message("act", {"command": rec["action"]})
            source = rec.get("action_source")
            target = None  # the act this state's example teaches, if any
            if source == "policy":  # DAgger: the target is the expert's command in this state, not the policy's
                label = rec.get("expert_action")
                if label and label not in cfg.drop_labels and label in admissible:
                    target = label
            elif source not in ("random", "invalid") and not (source == "expert" and rec["action"] in cfg.drop_labels):
                target = rec["action"]
            if cfg.parallel_calls:  # the pending meta-actions stay a target even when the command is not
                turn(("act", {"command": target}) if target else None)
            elif target:
                example(tool_call_message("act", {"command": target}))
            admissible = rec["admissible_commands"]
            ws.observe(step, obs)
            shown = final_observation(obs, rec["won"]) if rec["done"] else obs
            msgs.extend([call, {"role": "tool", "content": shown}])
            view.record_act(rec["action"], shown)
            if cfg.parallel_calls:  # the next turn reads this prompt, before the meta-actions below run
                turn_prompt = view.prompt(ws.render())
            if rec["done"]:
                break
            failures = failures + 1 if obs == NOTHING else 0
            if failures == 2:
                meta("recall", {"query": f"nothing happens {rec['action']}"}, step)
            seen_any = False
            for name in watched:
                for oid, where in _seen_objects(obs, name):
                    seen_any = True
                    if (oid, "location") not in ws.belief or ws.belief[(oid, "location")].value != where:
                        track(oid, "location", where, step)
                        found_at = found_at or (where if name == obj else None)
            shown_at = _contents_shown(obs)
            if obj and shown_at and not seen_any and cfg.track_searched:
                track(shown_at, "searched", "yes", step)
            m = re.match(rf"You pick up the ({obj} \d+)", obs) if obj else None
            if m:
                track(m.group(1), "location", "inventory", step)
            for verb, state in _EFFECTS.items():
                m = re.match(rf"You {verb} the ({obj} \d+)", obs) if obj else None
                if m:
                    track(m.group(1), "state", state, step)
            m = re.match(rf"You move the ({obj} \d+) to the ([a-z]+ \d+)", obs) if obj else None
            if m:  # placed (the first of two, in pick_two): no longer in the inventory
                track(m.group(1), "location", m.group(2), step)
            while next_goal < len(plan) and re.search(plan[next_goal][2], obs):
                gid, _text, _ = plan[next_goal]
                if not dropped("commit"):
                    deps = [last_committed] if last_committed else []
                    meta("commit", {"id": gid, "status": "done", "depends_on": deps}, step)
                    last_committed = gid
                next_goal += 1
        lesson = self.lesson(ep, obj, found_at) if obj else self.generic_lesson(ep)
        meta("note", {"lesson": lesson, "tags": [ep.task_type] + ([obj] if obj else [])}, len(ep.records))
        if cfg.parallel_calls:
            turn(None)  # the closing turn: the note alone
        return {"messages": msgs, "tools": json.dumps(TOOLS), "turns": turns, "episode_id": ep.episode_id,
                "game": ep.game, "won": ep.won, "meta_actions": dict(ws.usage.calls), "workspace": ws.render()}

    @staticmethod
    def generic_lesson(ep: Episode) -> str:
        """A lesson from a generic (non-ALFWorld) episode: its outcome and the commands that failed."""
        bad = sorted({r["action"] for r in ep.records[1:] if r["observation"].strip() == NOTHING})
        verdict = "won" if ep.won else "lost"
        return f"{ep.task}: {verdict} in {len(ep.records) - 1} steps" + (f"; failed: {', '.join(bad)}" if bad else "")

    @staticmethod
    def lesson(ep: Episode, obj: str, found_at: str | None) -> str:
        """A reusable lesson from one episode, failures included."""
        bad = [r["action"] for r in ep.records[1:] if r["observation"] == NOTHING]
        if any(a.startswith("put ") for a in bad):
            return "'put X in Y' does nothing: use 'move X to Y'"
        if found_at:
            place = re.sub(r" \d+$", "", found_at)
            verdict = "won" if ep.won else "lost"
            return f"{obj} was found at a {place} ({verdict} in {len(ep.records) - 1} steps)"
        return f"{obj} not found in {len(ep.records) - 1} steps: search other receptacles"


def is_dagger(ep: Episode) -> bool:
    """Whether the episode is a DAgger log (``evoharness.data.dagger``): the policy acted, the expert labelled. Its
    targets are the expert's whatever the policy's outcome, so ``won_only`` does not drop it."""
    return any(r.get("action_source") == "policy" for r in ep.records[1:])


def build_traces(episodes: list[Episode], cfg: TraceConfig, out_dir: str | Path,
                 experience_path: str | Path | None = None) -> dict:
    """Annotate every episode (sorted by episode id, DAgger ones last); write ``train.jsonl``/``valid.jsonl``.

    ``history`` context: one row per episode (``messages``, ``tools``). ``turn`` context: one prompt/completion row
    per policy turn; ``messages_mean`` then counts examples per episode and ``chars_mean`` the user message's length.

    Episodes with ``error`` or (when ``cfg.won_only``) unwon ones still add their lesson to Experience but are
    left out of the datasets; unwon DAgger episodes (``is_dagger``) are kept: their targets are the expert's.
    DAgger episodes are annotated after the others, against a copy of the Experience store, so their lessons
    change neither the expert episodes' examples nor the store written to ``experience_path``.
    The validation split holds whole games (``valid_share`` of them, by hash).
    Returns stats and ``content_hash``: sha256 of both files, so the same episodes give the same hash.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if experience_path and Path(experience_path).exists():
        Path(experience_path).unlink()
    teacher = Teacher(cfg, ExperienceStore(experience_path or ":memory:"))
    rows = {"train": [], "valid": []}
    stats = {"episodes": 0, "kept": 0, "steps": 0, "meta_actions": {}, "context": cfg.context, "harness": cfg.harness}
    lengths: dict[str, list[int]] = {"workspace_tokens": [], "messages": [], "chars": []}
    tools = json.dumps(TOOLS)
    dagger_teacher = None
    # DAgger episodes come after every expert one, against a copy of the store: the expert's examples (their recall
    # results) and the Experience store evaluation starts from are the same with or without them
    for ep in sorted(episodes, key=lambda e: (is_dagger(e), e.episode_id)):
        if is_dagger(ep) and dagger_teacher is None:
            dagger_teacher = Teacher(cfg, teacher.experience.copy_to(":memory:"))
        row = (dagger_teacher or teacher).annotate(ep)
        stats["episodes"] += 1
        if "error" in ep.records[-1] or (cfg.won_only and not ep.won and not is_dagger(ep)):
            continue
        if is_dagger(ep) and cfg.context != "turn":  # one conversation per episode would teach the policy's acts
            stats["dagger_skipped"] = stats.get("dagger_skipped", 0) + 1
            continue
        stats["dagger_episodes"] = stats.get("dagger_episodes", 0) + is_dagger(ep)
        bucket = int(hashlib.sha256(ep.game.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
        split = "valid" if bucket < cfg.valid_share else "train"
        turns = row.pop("turns")
        if cfg.context == "turn":
            copies = cfg.dagger_weight if is_dagger(ep) and split == "train" else 1
            for i, t in enumerate(turns):
                rows[split].extend([t | {"episode_id": ep.episode_id, "game": ep.game, "turn": i}
                                    | ({"tools": tools} if cfg.tools_in_prompt else {})] * copies)
                lengths["chars"].append(len(t["prompt"][-1]["content"]))
            lengths["messages"].append(len(turns))
        else:
            rows[split].append(row)
            lengths["messages"].append(len(row["messages"]))
            lengths["chars"].append(sum(len(m["content"]) + len(json.dumps(m.get("tool_calls", "")))
                                        for m in row["messages"]))
        stats["kept"] += 1
        stats["steps"] += len(ep.records) - 1
        lengths["workspace_tokens"].append(len(tokens(row["workspace"])))
        for k, v in row["meta_actions"].items():
            stats["meta_actions"][k] = stats["meta_actions"].get(k, 0) + v
    digest = hashlib.sha256()
    for split, split_rows in rows.items():
        text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in split_rows)
        (out / f"{split}.jsonl").write_text(text)
        digest.update(text.encode())
        stats[f"{split}_rows"] = len(split_rows)
    stats["meta_actions_per_episode"] = {k: v / max(stats["kept"], 1) for k, v in stats["meta_actions"].items()}
    for key, values in lengths.items():
        stats[f"{key}_mean"] = sum(values) / max(len(values), 1)
        stats[f"{key}_max"] = max(values, default=0)
    stats["content_hash"] = digest.hexdigest()
    stats["lessons"] = len(teacher.experience.all())
    (out / "stats.json").write_text(json.dumps(stats, indent=1, sort_keys=True))
    return stats
