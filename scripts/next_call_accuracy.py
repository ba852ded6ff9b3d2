"""Teacher-forced next-call accuracy of a turn-context policy on held-out trace examples: does the model, given
the exact prompt of a teacher turn, produce the teacher's call? Explains episode success turn by turn (a policy
right on 90 % of its calls rarely finishes a 20-step episode without a mistake).

    python scripts/next_call_accuracy.py --model runs/sft/<key>/final --traces runs/traces/<key>/valid.jsonl \
        [--limit 400] [--out docs/next-call-accuracy.md]

Greedy generation of the whole turn (``model.generate``), parsed with ``evoharness.policy.agent.parse_tool_calls``; in a
``traces.parallel_calls`` turn each teacher call is compared with the generated call in the same position.
Prints per tool (``act`` split by the command's verb: go, take, put, open, ...): examples, well-formed share,
right tool, exact arguments (for ``act``: the exact command). ``--limit`` examples evenly spaced over the file.
Exits 2 on a history-context file (its examples are whole episodes, not turns).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def expected_calls(row: dict) -> list[tuple[str, dict]]:
    """The teacher's calls of a turn-context trace row as [(tool name, arguments), ...]: one, or with
    ``traces.parallel_calls`` the turn's meta-actions then its act."""
    calls = []
    for c in row["completion"][0]["tool_calls"]:
        args = c["function"]["arguments"]
        calls.append((c["function"]["name"], json.loads(args) if isinstance(args, str) else args))
    return calls


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="model folder (or hub id)")
    p.add_argument("--traces", required=True, help="a turn-context valid.jsonl")
    p.add_argument("--limit", type=int, default=400)
    p.add_argument("--max-new-tokens", type=int, default=256, help="per turn (a parallel turn holds several calls)")
    p.add_argument("--out", default=None, help="also write the table as Markdown here")
    a = p.parse_args(argv)

    import torch

    from evoharness.config import TraceConfig
    from evoharness.harness.context import with_layout
    from evoharness.harness.workspace import TOOLS
    from evoharness.policy.agent import parse_tool_calls
    from evoharness.training.model import load_policy

    rows = [json.loads(x) for x in Path(a.traces).read_text().splitlines() if x.strip()]
    if not rows or "prompt" not in rows[0]:
        print(f"{a.traces}: not a turn-context trace file (rows need 'prompt' and 'completion')", file=sys.stderr)
        return 2
    if a.limit and a.limit < len(rows):
        rows = [rows[i * len(rows) // a.limit] for i in range(a.limit)]
    model, tok = load_policy(a.model)
    model.eval()
    layout = with_layout(TraceConfig(context="turn"), model.config)
    tools = TOOLS if layout.tools_in_prompt else None
    end = tok.convert_tokens_to_ids("<|im_end|>")
    stats: dict[str, Counter] = {}
    t0 = time.time()
    for i, row in enumerate(rows):
        want = expected_calls(row)
        text = tok.apply_chat_template(row["prompt"], tools=tools, add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.max_new_tokens,
                                 do_sample=False, eos_token_id=end, pad_token_id=tok.pad_token_id)
        got = parse_tool_calls(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=False))
        # a parallel turn: each teacher call against the generated call in the same position
        for j, (name, args) in enumerate(want):
            got_name, got_args = got[j] if j < len(got) else (None, {})
            key = f"act: {args.get('command', '').split(' ')[0]}" if name == "act" else name  # by verb: go, take...
            s = stats.setdefault(key, Counter())
            s["examples"] += 1
            s["well_formed"] += got_name is not None
            s["right_tool"] += got_name == name
            s["exact"] += got_name == name and got_args == args
        if (i + 1) % 100 == 0:
            rate = (i + 1) / (time.time() - t0)
            print(f"[accuracy] {i + 1}/{len(rows)} {rate:.1f} examples/s, ETA {(len(rows) - i - 1) / rate:.0f} s",
                  flush=True)
    total = Counter()
    for c in stats.values():
        total.update(c)
    lines = ["| call | examples | well-formed | right tool | exact call |", "| --- | --- | --- | --- | --- |"]
    for name, c in sorted(stats.items()) + [("all", total)]:
        n = c["examples"]
        lines.append(f"| {name} | {n} | {100 * c['well_formed'] / n:.1f} | {100 * c['right_tool'] / n:.1f} | "
                     f"{100 * c['exact'] / n:.1f} |")
    table = "\n".join(lines) + "\n\nShares in % of held-out teacher turns (greedy, teacher-forced prompts).\n"
    print(table)
    if a.out:
        Path(a.out).write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
