"""A generic episode log for any tool-using agent, converted into the raw execution-log records of ``rawlog``.

One JSON object per line, one line per episode (format ``evoharness.generic/v1``; see docs/generic-log-format.md):

| field | type | meaning |
| --- | --- | --- |
| format | str | always ``"evoharness.generic/v1"`` |
| episode_id | str | unique per episode (non-empty) |
| task | str | what the agent was asked to do (non-empty) |
| initial_observation | str | what the agent saw before its first action (may be ``""``) |
| steps | list[object] | the agent's actions in order (may be empty); each step is below |
| outcome | object | ``{"success": bool, "reward": number (optional, default 1.0 if success else 0.0)}`` |
| source | str, optional | the agent or system that produced the log (provenance only) |
| metadata | object, optional | anything else; ignored |

Each step:

| field | type | meaning |
| --- | --- | --- |
| action | str | the environment command (required, non-empty, for ``tool`` "env"); for another tool, optional: |
| | | the call's input as text, used when ``arguments`` is absent |
| tool | str, optional | the tool called; default ``"env"``, the environment itself |
| arguments | object, optional | the tool call's JSON arguments (not for ``"env"``) |
| result | str | what came back: the environment's observation or the tool's output |

Other fields are rejected (a misspelt ``reward`` or ``arguments`` would otherwise change the episode silently);
put extras in ``metadata``. Each episode becomes raw-log records (``to_records``): step 0 holds the initial
observation with the task appended as ``Your task is to: <task>`` (so ``Episode.task`` reads it back), step t the
t-th action rendered as text (``tool_call_text``) and its result; the last record is ``done`` with ``won`` = success
and reward = the outcome's reward; game is ``generic/<episode_id>``, task_type ``generic``.
"""

from __future__ import annotations

import json
import math

from evoharness.data.records import (
    TASK_MARKER,
    Episode,
    RawLogError,
    json_lines,
    task_of,
    validate_record,
    what_to_do,
)

FORMAT = "evoharness.generic/v1"
SUFFIX = ".generic.jsonl"
DOC = "docs/generic-log-format.md"

_TOP = {"format", "episode_id", "task", "initial_observation", "steps", "outcome", "source", "metadata"}
_STEP = {"action", "tool", "arguments", "result"}
_OUTCOME = {"success", "reward"}


def _fail(where: str, message: str) -> None:
    raise RawLogError(f"{where}: {message} (format {FORMAT}, see {DOC})")


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _check(obj: dict, name: str, label: str, types: tuple, where: str, required: bool = True) -> None:
    if name not in obj:
        if required:
            _fail(where, f"field {label!r} missing; add it")
        return
    value = obj[name]
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        expected = " or ".join("number" if t in (int, float) else "object" if t is dict else "list" if t is list
                               else t.__name__ for t in types if t is not float or int not in types)
        _fail(where, f"field {label!r} is {_type_name(value)}, expected {expected}")


def _unknown(obj: dict, allowed: set, prefix: str, where: str) -> None:
    extra = sorted(set(obj) - allowed)
    if extra:
        _fail(where, f"field {prefix + extra[0]!r} is not part of the format; remove it"
                     + (" or move it into 'metadata'" if not prefix else ""))


def validate_generic(obj: object, where: str) -> dict:
    """Check one decoded generic episode (a dict as in the module docstring); ``where`` is ``file:line``.

    Returns ``obj`` unchanged. Raises RawLogError ``"<where>: field '<name>' ..."`` naming the first bad field
    (nested ones as ``steps[2].result``, ``outcome.success``), what was expected and what to do.
    """
    if not isinstance(obj, dict):
        _fail(where, f"record is {_type_name(obj)}, expected a JSON object (one episode per line)")
    _check(obj, "format", "format", (str,), where)
    if obj["format"] != FORMAT:
        _fail(where, f"field 'format' is {obj['format']!r}, expected {FORMAT!r}")
    for name in ("episode_id", "task", "initial_observation"):
        _check(obj, name, name, (str,), where)
    _check(obj, "steps", "steps", (list,), where)
    _check(obj, "outcome", "outcome", (dict,), where)
    _check(obj, "source", "source", (str,), where, required=False)
    _check(obj, "metadata", "metadata", (dict,), where, required=False)
    _unknown(obj, _TOP, "", where)
    if not obj["episode_id"].strip():
        _fail(where, "field 'episode_id' is empty; give each episode a unique id")
    if not obj["task"].strip():
        _fail(where, "field 'task' is empty; state what the agent was asked to do")
    if TASK_MARKER in obj["initial_observation"] and task_of(obj["initial_observation"]) != obj["task"].strip():
        _fail(where, f"field 'initial_observation' contains {TASK_MARKER!r} with a task other than field 'task'; "
                     f"drop it from 'initial_observation' (the task is added from 'task')")
    for i, step in enumerate(obj["steps"]):
        label = f"steps[{i}]"
        if not isinstance(step, dict):
            _fail(where, f"field {label!r} is {_type_name(step)}, expected object")
        _check(step, "tool", f"{label}.tool", (str,), where, required=False)
        tool = step.get("tool", "env")
        if not tool.strip():
            _fail(where, f"field '{label}.tool' is empty; omit it for the environment or name the tool")
        _check(step, "action", f"{label}.action", (str,), where, required=tool == "env")
        _check(step, "arguments", f"{label}.arguments", (dict,), where, required=False)
        _check(step, "result", f"{label}.result", (str,), where)
        _unknown(step, _STEP, f"{label}.", where)
        if tool == "env" and not step["action"].strip():
            _fail(where, f"field '{label}.action' is empty; the environment step needs its command")
        if tool == "env" and "arguments" in step:
            _fail(where, f"field '{label}.arguments' is set for tool 'env'; put the command in "
                         f"'{label}.action' or name the tool in '{label}.tool'")
    outcome = obj["outcome"]
    _check(outcome, "success", "outcome.success", (bool,), where)
    _check(outcome, "reward", "outcome.reward", (int, float), where, required=False)
    _unknown(outcome, _OUTCOME, "outcome.", where)
    if "reward" in outcome and not math.isfinite(outcome["reward"]):
        _fail(where, f"field 'outcome.reward' is {outcome['reward']}, expected a finite number")
    return obj


def tool_call_text(step: dict) -> str:
    """One validated step -> the raw-log action text.

    ``tool`` "env" (or absent): ``action`` as is. Another tool: ``tool(<arguments as JSON>)`` when ``arguments``
    is given, else ``tool(<action as a JSON string>)``, else ``tool()``.
    """
    tool = step.get("tool", "env")
    if tool == "env":
        return step["action"]
    if "arguments" in step:
        return f"{tool}({json.dumps(step['arguments'], ensure_ascii=False, sort_keys=True)})"
    if "action" in step:
        return f"{tool}({json.dumps(step['action'], ensure_ascii=False)})"
    return f"{tool}()"


def to_records(obj: dict, where: str = "<generic episode>") -> list[dict]:
    """One generic episode -> its raw-log records (step 0, 1, ..., len(steps)), each passing ``validate_record``.

    Validates first (``where`` names the place in messages); raises RawLogError as ``validate_generic``.
    """
    validate_generic(obj, where)
    episode_id, success = obj["episode_id"], obj["outcome"]["success"]
    reward = float(obj["outcome"].get("reward", float(success)))
    initial = obj["initial_observation"]
    if TASK_MARKER not in initial:
        initial = (initial.rstrip() + "\n\n" if initial.strip() else "") + TASK_MARKER + obj["task"].strip()
    base = {"game": f"generic/{episode_id}", "task_type": "generic", "episode_id": episode_id, "perturbed": False}
    records = [{**base, "step": 0, "observation": initial, "admissible_commands": [], "action": None,
                "action_source": None, "reward": 0.0, "done": False, "won": False}]
    for i, step in enumerate(obj["steps"], 1):
        records.append({**base, "step": i, "observation": step["result"], "admissible_commands": [],
                        "action": tool_call_text(step), "action_source": "agent", "reward": 0.0, "done": False,
                        "won": False})
    records[-1].update(reward=reward, done=True, won=success)
    for rec in records:
        validate_record(rec, where)
    return records


def parse_generic_lines(lines, source: str, quarantine: list | None = None) -> list[Episode]:
    """Decode, validate and convert generic JSONL lines (one episode each; blank lines skipped) into episodes.

    Same contract as ``rawlog.parse_lines``: with ``quarantine`` None, the first bad line raises RawLogError
    ``"<source>:<line>: field '<name>' ..."``; with a list, each bad line is appended as ``{"where", "error",
    "line"}`` and its episode skipped. An ``episode_id`` used twice is ambiguous: both lines are reported.
    """
    episodes: dict[str, Episode] = {}
    first_seen: dict[str, tuple[str, str]] = {}

    def bad(where: str, error: str, line: str) -> None:
        if quarantine is None:
            raise RawLogError(error + what_to_do(where))
        quarantine.append({"where": where, "error": error, "line": line})

    for where, obj, line in json_lines(lines, source, bad):
        try:
            records = to_records(obj, where)
        except RawLogError as exc:
            bad(where, str(exc), line)
            continue
        episode_id = obj["episode_id"]
        if episode_id in first_seen:
            first_where, first_line = first_seen[episode_id]
            bad(where, f"{where}: field 'episode_id' is {episode_id!r}, already used at {first_where}; "
                       f"episode ids must be unique", line)
            if episodes.pop(episode_id, None) is not None:
                quarantine.append({"where": first_where, "error": f"{first_where}: field 'episode_id' is "
                                   f"{episode_id!r}, used again at {where}", "line": first_line})
            continue
        first_seen[episode_id] = (where, line)
        episodes[episode_id] = Episode(episode_id, records[0]["game"], "generic", records)
    return list(episodes.values())
