"""Stage cache keys cover the code each stage runs, and only that code."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tasks.caching import content_key, library_digest, module_closure
from tasks.traces import TRACES_CODE
from tasks.training import GRPO_CODE, SFT_CODE

ROOT = Path(__file__).resolve().parent.parent


def names(entries, root=ROOT):
    return {str(p.relative_to(root)) for p in module_closure(entries, root)}


def test_closure_follows_imports_inside_functions_and_leaves_unused_modules_out():
    sft = names(SFT_CODE)
    assert {"evoharness/training/sft.py", "evoharness/training/model.py", "evoharness/config.py"} <= sft
    assert "evoharness/evaluation/plots.py" not in sft and "evoharness/evaluation/evaluate.py" not in sft
    grpo = names(GRPO_CODE)
    # rollouts play episodes through the agent loop and the language-model policy
    assert {"evoharness/training/rollouts.py", "evoharness/policy/agent.py", "evoharness/policy/lm_policy.py",
            "evoharness/harness/workspace.py"} <= grpo
    assert "evoharness/harness/traces.py" in names(TRACES_CODE)


def test_a_change_outside_a_stage_keeps_its_key_a_change_inside_moves_it(tmp_path):
    shutil.copytree(ROOT / "evoharness", tmp_path / "evoharness", ignore=shutil.ignore_patterns("__pycache__"))
    before = library_digest(SFT_CODE, tmp_path)
    plots = tmp_path / "evoharness" / "evaluation" / "plots.py"
    plots.write_text('"""An edited docstring."""\n' + plots.read_text())
    assert library_digest(SFT_CODE, tmp_path) == before
    sft = tmp_path / "evoharness" / "training" / "sft.py"
    sft.write_text(sft.read_text() + "\n# a change the SFT stage runs\n")
    assert library_digest(SFT_CODE, tmp_path) != before


def test_a_subpackage_module_is_followed(tmp_path):
    pkg = tmp_path / "evoharness"
    (pkg / "training").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "training" / "__init__.py").write_text("")
    (pkg / "training" / "sft.py").write_text("from . import helpers\nfrom ..config import X\n")
    (pkg / "training" / "helpers.py").write_text("def f():\n    import evoharness.figures\n")
    (pkg / "config.py").write_text("X = 1\n")
    (pkg / "figures.py").write_text("")
    (pkg / "unused.py").write_text("")
    assert names(("evoharness.training.sft",), tmp_path) == {
        "evoharness/__init__.py", "evoharness/training/__init__.py", "evoharness/training/sft.py",
        "evoharness/training/helpers.py", "evoharness/config.py", "evoharness/figures.py"}


def test_unknown_entry_module_is_named():
    with pytest.raises(FileNotFoundError, match="evoharness.nosuch"):
        content_key(("evoharness.nosuch",), "x")
