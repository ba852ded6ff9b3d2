"""scripts/call_decisions.py: the released policy's probability of each tool name at a teacher turn's first call."""

import sys
from pathlib import Path

from evoharness.config import TraceConfig
from evoharness.harness.traces import Teacher
from tests.test_workspace_states import episode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import call_decisions  # noqa: E402

RELEASE = ROOT / "models" / "evoharness-full-sft"


def turn_rows() -> list[dict]:
    cfg = TraceConfig(context="turn", harness=True, recent_actions=8, parallel_calls=True, lesson_turns=1)
    row = Teacher(cfg).annotate(episode())
    return [t | {"episode_id": row["episode_id"], "turn": i} for i, t in enumerate(row["turns"])]


def test_name_prefix_stops_right_before_the_first_tool_name():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(RELEASE)
    for row in turn_rows():
        prefix = call_decisions.name_prefix(tok, row)
        full = tok.apply_chat_template(row["prompt"] + row["completion"], tokenize=False)
        first = row["completion"][0]["tool_calls"][0]["function"]["name"]
        assert full.startswith(prefix) and full[len(prefix):].startswith(f'{first}"')


def test_the_release_recalls_first_and_the_probabilities_are_a_distribution():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = turn_rows()
    tok, model = AutoTokenizer.from_pretrained(RELEASE), AutoModelForCausalLM.from_pretrained(RELEASE)
    result = call_decisions.decisions(model, tok, rows, [1.0, 0.5])
    firsts = [r["completion"][0]["tool_calls"][0]["function"]["name"] for r in rows]
    for by_teacher in result.values():
        assert {k: c["examples"] for k, c in by_teacher.items()} == {n: firsts.count(n) for n in set(firsts)}
        for c in by_teacher.values():
            assert 0.0 <= sum(c[f"p_{n}"] for n in call_decisions.NAMES) <= 1.0 + 1e-6
    # the teacher recalls at every task start, and so does the release, more surely at a lower temperature
    assert result["1.0"]["recall"]["p_recall"] > 0.9
    assert result["0.5"]["recall"]["p_recall"] >= result["1.0"]["recall"]["p_recall"]
