"""The raw execution-log schema: one record per step, its validation, the episode it belongs to, the task line.

One JSON object per line, one line per step of an episode:

| field | type | meaning |
| --- | --- | --- |
| game | str | game path relative to ``json_2.1.1`` |
| task_type | str | ALFWorld task type |
| episode_id | str | unique per episode |
| step | int | 0 for the initial observation, then 1, 2, ... |
| observation | str | step 0: the initial text (with the task); step t: the result of ``action`` |
| admissible_commands | list[str] | commands admissible *after* this record (for the next action) |
| action | str or null | the command executed at this step (null at step 0) |
| action_source | str or null | ``expert``, ``random``, ``invalid`` or ``policy`` (DAgger logs); null at step 0 |
| expert_action | str or null, optional | ``policy`` records: the expert's command where ``action`` was taken |
| reward | float | the environment's reward for this step |
| done | bool | the episode ended here (won, or out of steps) |
| won | bool | ALFWorld's ``won``: the success flag (never use ``done``) |
| perturbed | bool | the episode took non-expert actions at random steps |
| error | str, optional | why the episode ended early (the expert raised or stalled) |
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

# ALFWorld states the goal in the first observation after this marker; generic logs append it the same way
TASK_MARKER = "Your task is to: "


def task_of(observation: str) -> str:
    """The task text after ``TASK_MARKER`` in an observation ("put a clean soapbar in drawer"), "" without it."""
    return observation.split(TASK_MARKER, 1)[1].strip() if TASK_MARKER in observation else ""


FIELDS: dict[str, tuple] = {
    "game": (str,),
    "task_type": (str,),
    "episode_id": (str,),
    "step": (int,),
    "observation": (str,),
    "admissible_commands": (list,),
    "action": (str, type(None)),
    "action_source": (str, type(None)),
    "reward": (int, float),
    "done": (bool,),
    "won": (bool,),
    "perturbed": (bool,),
}


class RawLogError(ValueError):
    """A raw-log record that does not match the schema; the message names file, line and field (and, raised while
    reading a shard, what to do: ``what_to_do``)."""


def what_to_do(where: str) -> str:
    """The ways on from a bad record at ``where`` (``<shard>:<line>``), appended to the error that stops reading:
    fix the line, restore the shard DVC recorded, or quarantine bad records and go on."""
    shard, _, line = where.rpartition(":")
    return (f". To go on: fix line {line} of {shard} (then `dvc add` its folder to record the fixed version); or, "
            f"if the file was changed after DVC recorded it, restore the recorded version with `dvc checkout --force "
            f"{shard}` (this discards the changes); or set `ingest.on_error: quarantine` in the profile to set bad "
            f"records aside in runs/quarantine/ and go on without them")


@dataclass
class Episode:
    """One episode's records, in step order."""

    episode_id: str
    game: str
    task_type: str
    records: list[dict]

    @property
    def won(self) -> bool:
        return bool(self.records[-1]["won"])

    @property
    def task(self) -> str:
        return task_of(self.records[0]["observation"])


def validate_record(rec: object, where: str) -> dict:
    """Check one decoded record against ``FIELDS``; ``where`` is ``file:line`` for the message.

    Raises RawLogError naming the place and the field, and what was expected.
    """
    if not isinstance(rec, dict):
        raise RawLogError(f"{where}: record is {type(rec).__name__}, expected a JSON object")
    for name, types in FIELDS.items():
        if name not in rec:
            raise RawLogError(f"{where}: field {name!r} missing")
        value = rec[name]
        if isinstance(value, bool) and bool not in types:
            raise RawLogError(f"{where}: field {name!r} is a bool, expected {types[0].__name__}")
        if not isinstance(value, types):
            raise RawLogError(f"{where}: field {name!r} is {type(value).__name__}, expected "
                              + " or ".join("null" if t is type(None) else t.__name__ for t in types))
    if not all(isinstance(c, str) for c in rec["admissible_commands"]):
        raise RawLogError(f"{where}: field 'admissible_commands' must be a list of strings")
    if rec["step"] > 0 and rec["action"] is None:
        raise RawLogError(f"{where}: field 'action' is null at step {rec['step']}; only step 0 has no action")
    if rec["step"] == 0 and rec["action"] is not None:
        raise RawLogError(f"{where}: field 'action' is {rec['action']!r} at step 0; step 0 is the initial observation")
    if rec["step"] < 0:
        raise RawLogError(f"{where}: field 'step' is {rec['step']}; steps count from 0")
    if "error" in rec and not isinstance(rec["error"], str):
        raise RawLogError(f"{where}: field 'error' is {type(rec['error']).__name__}, expected str")
    if rec.get("expert_action") is not None and not isinstance(rec["expert_action"], str):
        raise RawLogError(f"{where}: field 'expert_action' is {type(rec['expert_action']).__name__}, expected str")
    if rec["reward"] != rec["reward"]:
        raise RawLogError(f"{where}: field 'reward' is NaN")
    return rec


def json_lines(lines: Iterable[str], source: str, bad: Callable[[str, str, str], None]) -> Iterator[tuple]:
    """``(where, object, line)`` for each non-blank line of a log (``where`` = ``source:lineno``, 1-based); a line
    that is not JSON goes to ``bad(where, error, line)`` (which raises or quarantines) and is skipped."""
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            yield where, json.loads(line), line
        except json.JSONDecodeError as exc:
            bad(where, f"{where}: not valid JSON ({exc.msg}; column {exc.colno})", line)
