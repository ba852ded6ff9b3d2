"""How sure a turn-context policy is about calling a meta-action where its teacher does: the probability the policy
gives each tool name at a turn's first tool call, on the exact prompts of teacher turns.

    python scripts/call_decisions.py --model models/evoharness-full-sft \
        --traces runs/traces/<key>/train.jsonl [--limit 400] [--temperature 1.0 0.7] [--out docs/experiments/X]

GRPO learns only from what its rollouts sample: where the policy gives the teacher's call a probability near 1, a
rollout almost never plays the turn without it, and a price on calls has no pair of turns to compare (journal item
27). For each example (``--limit`` of them, evenly spaced over the file) the prompt and the completion up to its first
tool name are encoded, and the next-token distribution (at each ``--temperature``, as sampling at that temperature
draws) is read at the five names, each one token of the policy's tokenizer. Prints, per teacher's first call: the
examples, the mean probability of each name, and the share of examples where a rollout at that temperature plays
no meta-action first (``act``) with probability at least 0.05. Writes ``OUT.json`` and ``OUT.md`` with ``--out``.
Exits 2 when a name is not one token, or the file holds history-context rows (no ``prompt``/``completion``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as `python scripts/call_decisions.py`

NAMES = ("track", "commit", "recall", "note", "act")


def name_prefix(tokenizer, row: dict) -> str:
    """The rendered prompt and completion up to (not including) the first tool call's name. Raises ValueError for a
    completion without a tool call."""
    prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(row["prompt"] + row["completion"], tokenize=False)
    marker = '"name": "'
    at = full.find(marker, len(prompt))
    if at < 0:
        raise ValueError(f"episode {row.get('episode_id')} turn {row.get('turn')}: the completion has no tool call")
    return full[:at + len(marker)]


def decisions(model, tokenizer, rows: list[dict], temperatures: list[float]) -> dict:
    """Per temperature and teacher's first call name: examples, mean probability of each name, and the share of
    examples with P(act) >= 0.05. Shapes: one forward pass per example (batch 1), logits [vocab] at the last token.
    Raises ValueError when a tool name is not one token of ``tokenizer``."""
    import torch

    ids = {n: tokenizer.convert_tokens_to_ids(n) for n in NAMES}
    for n, i in ids.items():
        if i is None or i == tokenizer.unk_token_id or tokenizer.decode([i]) != n:
            raise ValueError(f"tool name {n!r} is not one token of this tokenizer; this script reads one per name")
    out = {str(t): {} for t in temperatures}
    model.eval()
    with torch.no_grad():
        for row in rows:
            teacher = row["completion"][0]["tool_calls"][0]["function"]["name"]
            enc = tokenizer(name_prefix(tokenizer, row), return_tensors="pt", add_special_tokens=False)
            logits = model(**enc).logits[0, -1].float()
            for t in temperatures:
                p = torch.softmax(logits / t, dim=-1)
                cell = out[str(t)].setdefault(teacher, {"examples": 0, "skip_explored": 0,
                                                        **{f"p_{n}": 0.0 for n in NAMES}})
                cell["examples"] += 1
                for n in NAMES:
                    cell[f"p_{n}"] += float(p[ids[n]])
                cell["skip_explored"] += int(float(p[ids["act"]]) >= 0.05)
    for by_teacher in out.values():
        for cell in by_teacher.values():
            k = cell["examples"]
            for key in [f"p_{n}" for n in NAMES] + ["skip_explored"]:
                cell[key] = cell[key] / k
    return out


def markdown(result: dict) -> str:
    """One table per temperature: a row per teacher's first call."""
    lines = []
    for t, by_teacher in result.items():
        lines += [f"temperature {t}", "", "| teacher calls first | examples | " + " | ".join(f"P({n})" for n in NAMES)
                  + " | share with P(act) >= 0.05 |", "|" + " --- |" * (len(NAMES) + 3)]
        for teacher in NAMES:
            c = by_teacher.get(teacher)
            if c:
                lines.append(f"| {teacher} | {c['examples']} | " + " | ".join(f"{c[f'p_{n}']:.4f}" for n in NAMES)
                             + f" | {c['skip_explored']:.3f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a release folder or a saved model directory")
    p.add_argument("--traces", required=True, help="a turn-context trace file (train.jsonl or valid.jsonl)")
    p.add_argument("--limit", type=int, default=400, help="examples, evenly spaced over the file (0: all)")
    p.add_argument("--temperature", type=float, nargs="+", default=[1.0, 0.7])
    p.add_argument("--out", help="write OUT.json and OUT.md")
    a = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from evoharness.evaluation.evaluate import spread  # the evaluation's evenly spaced choice of games

    with open(a.traces) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if rows and "completion" not in rows[0]:
        print(f"{a.traces}: history-context rows (whole episodes); this script reads turn-context examples",
              file=sys.stderr)
        return 2
    rows = spread(rows, a.limit)
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model)
    try:
        result = decisions(model, tokenizer, rows, a.temperature)
    except ValueError as e:
        print(f"{a.model}: {e}", file=sys.stderr)
        return 2
    text = markdown(result)
    print(f"{a.model} on {len(rows)} examples of {a.traces}\n\n{text}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(f"{a.out}.json").write_text(json.dumps({"model": a.model, "traces": a.traces, "examples": len(rows),
                                                     "by_temperature": result}, indent=1))
        Path(f"{a.out}.md").write_text(f"`{a.model}` on {len(rows)} examples of `{a.traces}`\n\n{text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
