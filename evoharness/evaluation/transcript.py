"""Print one episode transcript (``transcripts.jsonl`` written by evaluation) as a readable table.

    python -m evoharness.evaluation.transcript runs/eval/<run>/evaluate-valid_seen/transcripts.jsonl [--episode N]
    [--width W]
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path


def load_episode(path: str | Path, index: int = 0) -> dict:
    """The ``index``-th episode of a transcripts JSONL file. Raises IndexError naming the file and its length."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: no such transcript file (evaluation writes runs/eval/<run>/<name>/"
                                f"transcripts.jsonl)")
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    if not 0 <= index < len(lines):
        raise IndexError(f"{path} holds {len(lines)} episodes; --episode {index} is out of range")
    return json.loads(lines[index])


def load_episodes(path: str | Path) -> list[dict]:
    """Every episode of a transcripts JSONL file (one JSON object per line; blank lines skipped).

    Raises FileNotFoundError when it is missing, ValueError naming the file and line when a line is not JSON, and
    ValueError when it holds no episode."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: no such transcript file (evaluation writes runs/eval/<run>/<name>/"
                                f"transcripts.jsonl)")
    episodes = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                episodes.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {i}: not JSON ({e.msg}); is this an evaluation's "
                                 "transcripts.jsonl?") from e
    if not episodes:
        raise ValueError(f"{path}: no episodes")
    return episodes


def format_table(episode: dict, width: int = 60) -> str:
    """Turn, tool, arguments, result, cost and the workspace after each turn, as fixed-width text."""
    head = (f"game {episode['game']}  won={episode['won']}  env steps={episode['env_steps']}  "
            f"meta-actions={episode['meta_actions']}  cost={episode['cost']:.4f}  reward={episode['reward']:.4f}")
    rows = [head, f"{'#':>3} {'tool':<8} {'call':<{width // 2}} {'result':<{width}} {'cost':>7}  workspace"]
    for i, t in enumerate(episode["transcript"]):
        call = t.get("command") or json.dumps(t.get("args", {}))
        result = textwrap.shorten(str(t.get("result", "")).replace("\n", " | "), width=width, placeholder="...")
        ws = str(t.get("workspace", "")).replace("\n", " | ")
        rows.append(f"{i:>3} {t['turn']:<8} {textwrap.shorten(call, width // 2, placeholder='...'):<{width // 2}} "
                    f"{result:<{width}} {t.get('cost', 0.0):>7.4f}  {textwrap.shorten(ws, 80, placeholder='...')}")
    if episode.get("error"):
        rows.append(f"error: {episode['error']}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Print one episode transcript as a table.")
    p.add_argument("file")
    p.add_argument("--episode", type=int, default=0)
    p.add_argument("--width", type=int, default=60)
    a = p.parse_args(argv)
    try:
        episode = load_episode(a.file, a.episode)
    except (FileNotFoundError, IndexError) as exc:
        raise SystemExit(f"error: {exc.args[0]}") from None
    print(format_table(episode, a.width))


if __name__ == "__main__":
    main()
