"""Why evaluation episodes were lost: counts over an evaluation's ``transcripts.jsonl`` (one JSON object per episode,
as ``evoharness.evaluation.evaluate`` writes it under ``runs/eval/<run>/evaluate-<split>/``).

    python scripts/failure_modes.py runs/eval/<run>/evaluate-valid_seen/transcripts.jsonl \
        [--max-env-steps 50] [--out docs/failure-modes.md]

For each lost episode (``won`` false) it asks, from the transcript alone:

- **budget**: did it use all ``--max-env-steps`` environment steps?
- **loop**: were its last 10 environment commands at most 3 distinct ones?
- **object seen, not taken**: did an observation name the task's object (``apple 2`` for an ALFWorld game
  ``pick_heat_then_place_in_recep-Apple-None-...``) while no ``take`` of that object type was ever executed?
- **object never seen**: no observation named it (the search failed).
- **revisits**: the most times one ``go to`` command was repeated.
- **meta-actions**: meta-action calls executed, and refused (over the budget, bad arguments, unknown tool), per lost
  episode.

Commands are the executed ones (``command``; the generated ``args.command`` where a row lacks it). Episodes whose
environment failed (``evoharness.evaluation.evaluate.environment_failed``) are counted apart and not classified.

The object type comes from the ALFWorld game folder name; episodes of games named otherwise are counted as
"object unknown". Prints a table (and writes it as Markdown with ``--out``). Exits 2 when the file holds no episodes.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from evoharness.evaluation.transcript import load_episodes  # noqa: E402

LOOP_WINDOW = 10
LOOP_DISTINCT = 3


def task_object(game: str) -> str | None:
    """The task's object type, lower case, from an ALFWorld game path
    (``.../pick_cool_then_place_in_recep-Apple-None-Fridge-12/trial_.../game.tw-pddl`` -> ``apple``); None when the
    path does not follow ALFWorld's ``<task type>-<Object>-<Mover>-<Receptacle>-<scene>`` naming."""
    for part in Path(game).parts:
        fields = part.split("-")
        if len(fields) == 5 and fields[4].isdigit():
            return fields[1].lower()
    return None


def episode_failure(episode: dict, max_env_steps: int) -> dict:
    """The failure flags of one transcript row (keys: ``budget``, ``loop``, ``seen_not_taken``, ``never_seen``,
    ``object_unknown`` as booleans; ``revisits``, ``meta_actions`` (executed) and ``rejected`` (refused: over the
    meta-action budget, bad arguments, unknown tool) as ints). Raises KeyError naming the field when
    the row lacks ``transcript`` or ``game``."""
    acts = [s for s in episode["transcript"] if s.get("turn") == "act"]
    commands = [s.get("command") or s.get("args", {}).get("command", "") for s in acts]  # executed, else generated
    obj = task_object(episode["game"])
    seen = taken = False
    if obj is not None:
        named = re.compile(rf"\b{re.escape(obj)} \d+\b")
        seen = any(named.search(str(s.get("result", "")).lower()) for s in acts)
        taken = any(c.startswith(f"take {obj} ") for c in commands)
    tail = commands[-LOOP_WINDOW:]
    gos = Counter(c for c in commands if c.startswith("go to "))
    return {
        "budget": len(acts) >= max_env_steps,
        "loop": len(tail) == LOOP_WINDOW and len(set(tail)) <= LOOP_DISTINCT,
        "seen_not_taken": obj is not None and seen and not taken,
        "never_seen": obj is not None and not seen,
        "object_unknown": obj is None,
        "revisits": max(gos.values(), default=0),
        "meta_actions": sum(s.get("turn") != "act" and s.get("ok") is True for s in episode["transcript"]),
        "rejected": sum(s.get("turn") != "act" and s.get("ok") is False for s in episode["transcript"]),
    }


def failure_table(episodes: list[dict], max_env_steps: int) -> list[tuple[str, str]]:
    """(row label, figure) pairs over the lost episodes of ``episodes``; shares are of lost episodes."""
    from evoharness.evaluation.evaluate import environment_failed

    failed = [environment_failed(e.get("error")) for e in episodes]
    lost = [episode_failure(e, max_env_steps) for e, f in zip(episodes, failed) if not e.get("won") and not f]
    n = len(lost)

    def share(key: str) -> str:
        k = sum(f[key] for f in lost)
        return f"{k} ({100 * k / n:.0f} %)" if n else "0"

    rows = [("episodes", str(len(episodes))), ("won", str(sum(bool(e.get("won")) for e in episodes))),
            ("environment failed (not classified)", str(sum(failed))), ("lost", str(n))]
    rows += [(f"lost: used all {max_env_steps} environment steps", share("budget")),
             (f"lost: last {LOOP_WINDOW} commands are at most {LOOP_DISTINCT} distinct (loop)", share("loop")),
             ("lost: task object seen, never taken", share("seen_not_taken")),
             ("lost: task object never seen", share("never_seen")),
             ("lost: object type unknown (not an ALFWorld game name)", share("object_unknown"))]
    if n:
        rows += [("lost: mean most repeats of one `go to`", f"{sum(f['revisits'] for f in lost) / n:.1f}"),
                 ("lost: mean meta-actions executed per episode", f"{sum(f['meta_actions'] for f in lost) / n:.1f}"),
                 ("lost: mean meta-action calls refused per episode", f"{sum(f['rejected'] for f in lost) / n:.1f}")]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("transcripts", help="an evaluation's transcripts.jsonl")
    p.add_argument("--max-env-steps", type=int, default=50,
                   help="the evaluation's environment step budget (evaluate.max_env_steps: 50 in the full profile)")
    p.add_argument("--out", default=None, help="also write the table as Markdown here")
    a = p.parse_args(argv)
    try:
        episodes = load_episodes(a.transcripts)
    except (ValueError, FileNotFoundError) as e:
        print(e, file=sys.stderr)
        return 2
    rows = failure_table(episodes, a.max_env_steps)
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    if a.out:
        md = [f"Failure modes of `{a.transcripts}` (scripts/failure_modes.py)", "", "| | |", "| --- | --- |"]
        Path(a.out).write_text("\n".join(md + [f"| {k} | {v} |" for k, v in rows]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
