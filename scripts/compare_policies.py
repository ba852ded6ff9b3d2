"""Compare evaluation summaries of several policies on one split: a Markdown table and a bar chart by task type.

    python scripts/compare_policies.py --out docs/valid-seen-policies \
        random=runs/issue5/random.json expert=runs/issue5/expert.json plain=runs/issue5/full-plain.json \
        harness=runs/issue5/full.json

Each JSON is what ``flows.evaluate --summary-json`` or ``flows.pipeline --summary-json`` writes. Writes ``OUT.md``
(the table) and ``OUT.png`` (success by task type); prints the table. With ``--mlflow-run RUN_ID`` both files are
also logged as artifacts of that run. Exits 2 when the summaries are not on the same split and number of games.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TYPES = ("Pick", "Clean", "Heat", "Cool", "Look", "Pick Two")
META = ("track", "commit", "recall", "note")


def table(summaries: dict[str, dict]) -> str:
    """Markdown: success rate by task type and overall, then mean steps, meta-actions and tokens per episode."""
    head = ["policy", *TYPES, "All", "mean steps", *[f"{m}/ep" for m in META], "tokens/ep"]
    first = next(iter(summaries.values()))
    counts = first["episodes_by_task_type"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head),
             "| games | " + " | ".join(str(counts.get(t, 0)) for t in TYPES) + f" | {first['episodes']} |"
             + " |" * (len(head) - len(TYPES) - 2)]
    for name, s in summaries.items():
        by = s["success_by_task_type"]
        cells = [f"{100 * by[t]:.1f}" if t in by else "-" for t in TYPES]
        cells.append(f"**{100 * s['success_rate']:.1f}**")
        cells.append(f"{s['mean_steps']:.1f}")
        cells += [f"{s['meta_actions_per_episode'].get(m, 0):.2f}" for m in META]
        cells.append(f"{s.get('generated_tokens_per_episode', 0):.0f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\nSuccess in % of games (ALFWorld's `won`).\n"


def figure(summaries: dict[str, dict]):
    """Matplotlib bar chart: success rate (%) by task type and overall, one bar per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [*TYPES, "All"]
    fig, ax = plt.subplots(figsize=(10, 3.8))
    width = 0.8 / len(summaries)
    for i, (name, s) in enumerate(summaries.items()):
        vals = [100 * s["success_by_task_type"].get(t, 0.0) for t in TYPES] + [100 * s["success_rate"]]
        ax.bar([g + i * width for g in range(len(groups))], vals, width, label=name)
    ax.set_xticks([g + width * (len(summaries) - 1) / 2 for g in range(len(groups))], groups)
    first = next(iter(summaries.values()))
    ax.set_ylabel("success %"), ax.set_ylim(0, 100), ax.legend(ncol=len(summaries), loc="upper left")
    ax.set_title(f"{first['split']}: {first['episodes']} games")
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("summaries", nargs="+", help="NAME=summary.json, in table order")
    p.add_argument("--out", required=True, help="output path without suffix (writes .md and .png)")
    p.add_argument("--mlflow-run", default=None, help="also log both files to this MLflow run")
    a = p.parse_args(argv)
    summaries = {}
    for item in a.summaries:
        name, _, path = item.partition("=")
        if not path or not Path(path).exists():
            print(f"{item!r}: expected NAME=path/to/summary.json of an existing file", file=sys.stderr)
            return 2
        summaries[name] = json.loads(Path(path).read_text())
    keys = {(s["split"], s["episodes"]) for s in summaries.values()}
    if len(keys) != 1:
        print(f"summaries differ in split or number of games: {sorted(keys)}", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    md = table(summaries)
    out.with_suffix(".md").write_text(md)
    figure(summaries).savefig(out.with_suffix(".png"), dpi=110)
    if a.mlflow_run:
        import mlflow

        from evoharness.tracking import configure

        configure(str(Path(__file__).resolve().parent.parent))
        with mlflow.start_run(run_id=a.mlflow_run):
            mlflow.log_artifact(str(out.with_suffix(".md")))
            mlflow.log_artifact(str(out.with_suffix(".png")))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
