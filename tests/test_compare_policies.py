"""scripts/compare_policies.py: the README's policy table and figure from evaluation summaries."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import compare_policies  # noqa: E402


def summary(success: dict, split="valid_seen"):
    n = {"Pick": 2, "Look": 1}
    return {"split": split, "episodes": 3, "episodes_by_task_type": n, "success_by_task_type": success,
            "success_rate": sum(success[t] * n[t] for t in n) / 3, "mean_steps": 12.5,
            "meta_actions_per_episode": {"track": 1.0, "commit": 2.0, "recall": 1.0, "note": 1.0},
            "generated_tokens_per_episode": 321.0}


def test_table_and_figure(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(summary({"Pick": 0.5, "Look": 1.0}) | {"malformed_per_episode": 0.5}))
    b.write_text(json.dumps(summary({"Pick": 1.0, "Look": 0.0}) | {"malformed_per_episode": 2.0,
                                                                   "rejected_turns_per_episode": 2.25}))
    assert compare_policies.main([f"expert={a}", f"harness={b}", "--out", str(tmp_path / "cmp")]) == 0
    rows = (tmp_path / "cmp.md").read_text().splitlines()
    assert rows[2] == "| games | 2 | 0 | 0 | 0 | 1 | 0 | 3 | | | | | | | | |"
    # a summary from before rejected turns were counted shows "-" there
    assert rows[3] == ("| expert | 50.0 | - | - | - | 100.0 | - | **66.7** | 12.5 | 1.00 | 2.00 | 1.00 | 1.00 "
                       "| 0.50 | - | 321 |")
    assert rows[4].startswith("| harness | 100.0 | - | - | - | 0.0 | - | **66.7** |")
    assert rows[4].endswith("| 2.00 | 2.25 | 321 |")
    assert (tmp_path / "cmp.png").stat().st_size > 10_000


def test_grpo_histories_add_a_panel_and_a_resumed_step_counts_once(tmp_path):
    a = tmp_path / "a.json"
    a.write_text(json.dumps(summary({"Pick": 0.5, "Look": 1.0})))
    h = tmp_path / "history.jsonl"
    h.write_text("".join(json.dumps({"step": s, "meta_actions": m}) + "\n" for s, m in [(0, 30), (1, 20), (1, 10)]))
    assert compare_policies.main([f"sft={a}", "--history", f"grpo={h}", "--out", str(tmp_path / "cmp")]) == 0
    assert compare_policies.read_history(h) == [{"step": 0, "meta_actions": 30}, {"step": 1, "meta_actions": 10}]
    assert (tmp_path / "cmp.png").stat().st_size > 10_000
    assert compare_policies.main([f"sft={a}", "--history", "grpo=missing.jsonl", "--out", str(tmp_path / "x")]) == 2


def test_summaries_of_different_splits_are_refused(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(summary({"Pick": 0.5, "Look": 1.0})))
    b.write_text(json.dumps(summary({"Pick": 0.5, "Look": 1.0}, split="valid_train")))
    assert compare_policies.main([f"x={a}", f"y={b}", "--out", str(tmp_path / "cmp")]) == 2
