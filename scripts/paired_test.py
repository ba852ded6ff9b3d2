"""Paired comparison of two evaluations on the same games: exact McNemar test on the games only one of them won.

    python scripts/paired_test.py A B [--names A-NAME B-NAME]

A and B are each an evaluation summary (``--summary-json`` of ``flows.pipeline`` or ``flows.evaluate``, or a copy
in ``docs/eval/``; its ``won_by_game``, recorded since 2026-12-02) or an evaluation's ``transcripts.jsonl`` (one
JSON object per episode with ``game`` and ``won``, under ``runs/eval/<run>/evaluate-<split>/``). Only the games in
both are compared. Prints the four counts and the two-sided p-value. The exact McNemar test is a two-sided binomial
test of the discordant pairs against p = 0.5 (McNemar 1947; ``scipy.stats.binomtest``). Exits 2 when a file has no
per-game outcomes or the two share no game.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from evoharness.evaluation.stats import mcnemar_exact  # noqa: E402,F401  (re-exported for callers of this script)
from evoharness.evaluation.transcript import load_episodes  # noqa: E402


def load_outcomes(path: str | Path) -> dict[str, bool]:
    """``{game: won}`` from a summary JSON (``won_by_game``) or a ``transcripts.jsonl``.

    Raises ValueError naming the file when it holds neither (e.g. a summary written before ``won_by_game`` existed:
    evaluate again, or use that run's ``transcripts.jsonl``), and FileNotFoundError when it is missing."""
    path = Path(path)
    text = path.read_text()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        doc = None  # several JSON lines: a transcripts file
    if isinstance(doc, dict):
        if "won_by_game" in doc and doc["won_by_game"] is not None:
            return {g: bool(w) for g, w in doc["won_by_game"].items()}
        if "game" in doc and "won" in doc:  # a transcripts file of one episode
            return {doc["game"]: bool(doc["won"])}
        raise ValueError(f"{path}: a summary without 'won_by_game' (written before 2026-12-02?); "
                         "compare that run's transcripts.jsonl instead, or evaluate again")
    episodes = load_episodes(path)
    for i, row in enumerate(episodes, 1):
        if not isinstance(row, dict) or "game" not in row or "won" not in row:
            raise ValueError(f"{path}, episode {i}: no 'game' and 'won' fields; expected a transcripts.jsonl row")
    return {row["game"]: bool(row["won"]) for row in episodes}


def main(argv: list[str] | None = None) -> dict:
    """Print the paired comparison of two evaluations (see the module docstring) and return ``mcnemar_exact``'s
    dict; exits 2 with the reason on bad input."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--names", nargs=2, default=None, metavar=("A_NAME", "B_NAME"))
    args = p.parse_args(argv)
    na, nb = args.names or (args.a, args.b)
    try:
        r = mcnemar_exact(load_outcomes(args.a), load_outcomes(args.b))
    except (ValueError, FileNotFoundError) as e:
        print(f"paired_test: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"{r['games']} games in both: {na} won {r['won_a']}, {nb} won {r['won_b']}")
    print(f"won by both {r['both']}, only {na} {r['only_a']}, only {nb} {r['only_b']}, neither {r['neither']}; "
          f"exact McNemar p = {r['p']:.4f}")
    return r


if __name__ == "__main__":
    main()
