"""SFT and GRPO on tiny settings, through the same `accelerate launch` path the pipeline uses."""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from evoharness.config import CostConfig, GRPOStageConfig, ModelConfig, SFTStageConfig, TraceConfig
from evoharness.data.rawlog import parse_lines
from evoharness.env.alfworld import list_games
from evoharness.harness.traces import build_traces
from evoharness.training.launch import accelerate_launch
from evoharness.training.model import build_default_model, load_policy

pytestmark = pytest.mark.slow  # real training runs: `make test-fast` leaves them out

TINY_MODEL = ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, vocab_size=600)


@pytest.fixture(scope="module")
def traces(tmp_path_factory, tiny_logs):
    out, _ = tiny_logs
    eps = parse_lines((out / "logs" / "shard-00000.jsonl").read_text().splitlines(), "shard")
    d = tmp_path_factory.mktemp("traces")
    build_traces(eps, dataclasses.replace(TraceConfig(), valid_share=0.0), d, experience_path=d / "exp.db")
    return d


@pytest.fixture(scope="module")
def base_model(tmp_path_factory, traces):
    return build_default_model(TINY_MODEL, traces / "train.jsonl", tmp_path_factory.mktemp("base"))


def test_default_model_speaks_qwen3_tool_format(base_model):
    from trl.chat_template_utils import supports_tool_calling

    model, tok = load_policy(base_model)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert supports_tool_calling(tok)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert len(tok.tokenize("<tool_call>")) == 1


def test_sft_runs_and_resumes_with_same_step_and_optimizer(tmp_path, traces, base_model):
    spec = {"model_path": base_model, "train_file": str(traces / "train.jsonl"), "output_dir": str(tmp_path),
            "sft": dataclasses.asdict(SFTStageConfig(max_steps=2, per_device_train_batch_size=1, save_steps=1,
                                                     logging_steps=1))}
    first = accelerate_launch("evoharness.training.sft", spec, tmp_path, num_processes=1)
    assert first["global_step"] == 2 and first["world_size"] == 1 and first["resumed_from"] is None
    assert first["first_loss"] > 0
    ckpt = tmp_path / "checkpoints" / "checkpoint-2"
    assert (ckpt / "optimizer.pt").exists()
    recorded = json.loads((ckpt / "train_seconds.json").read_text())
    assert recorded["global_step"] == 2 and 0 < recorded["train_seconds"] <= first["train_runtime_s"] + 1.0
    spec["sft"]["max_steps"] = 3
    second = accelerate_launch("evoharness.training.sft", spec, tmp_path, num_processes=1)
    assert second["resumed_from"].endswith("checkpoint-2") and second["global_step"] == 3
    # the whole training's seconds: those up to checkpoint-2 plus the resumed launch's
    assert second["earlier_launches_s"] == recorded["train_seconds"]
    assert second["train_runtime_s"] == pytest.approx(recorded["train_seconds"] + second["launch_runtime_s"], abs=1e-3)
    state = json.loads((tmp_path / "checkpoints" / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3


def test_grpo_step_runs_on_a_real_game(tmp_path, base_model, traces):
    game = list_games("train", limit=1, offset=1000)
    cfg = GRPOStageConfig(num_generations=2, prompts_per_step=1, max_steps=1, max_env_steps=2, max_meta_actions=1,
                          max_new_tokens=16)
    spec = {"model_path": base_model, "games": game, "output_dir": str(tmp_path),
            "experience_path": str(tmp_path / "exp.db"), "grpo": dataclasses.asdict(cfg),
            "cost": dataclasses.asdict(CostConfig())}
    result = accelerate_launch("evoharness.training.grpo", spec, tmp_path, num_processes=1)
    assert result["global_step"] == 1
    first = result["first"]
    assert first["env_steps"] == 2.0 and first["success_rate"] == 0.0
    assert first["reward"] == pytest.approx(-first["cost"])
    assert first["generated_tokens"] > 0
    assert (tmp_path / "final" / "model.safetensors").exists()


def test_sft_two_cpu_processes_run_ddp_with_world_size_2(tmp_path, traces, base_model):
    """`accelerate/cpu_2proc.yaml` really starts two processes (the `--cpu` flag alone silently runs one)."""
    spec = {"model_path": base_model, "train_file": str(traces / "train.jsonl"), "output_dir": str(tmp_path),
            "sft": dataclasses.asdict(SFTStageConfig(max_steps=1, per_device_train_batch_size=1, num_processes=2))}
    result = accelerate_launch("evoharness.training.sft", spec, tmp_path, num_processes=2)
    assert result["world_size"] == 2 and result["global_step"] == 1


def test_time_budget_plans_the_steps_from_a_measured_calibration_and_a_resume_keeps_the_plan(tmp_path, traces,
                                                                                             base_model):
    """``sft.time_budget_s``: both processes train the step count rank 0 planned from its calibration steps, the
    plan is saved beside the checkpoints, and a re-run resumes to the same step counter instead of re-planning.

    The margin (3x the calibrated seconds a step) keeps the planned steps well inside the budget, so the guard
    that stops at the budget regardless (tested below) does not race the plan on a slow or busy machine."""
    cfg = SFTStageConfig(time_budget_s=25, calibration_steps=6, time_budget_margin=3.0,
                         per_device_train_batch_size=1, save_steps=10, num_processes=2)
    spec = {"model_path": base_model, "train_file": str(traces / "train.jsonl"), "output_dir": str(tmp_path),
            "sft": dataclasses.asdict(cfg)}
    first = accelerate_launch("evoharness.training.sft", spec, tmp_path, num_processes=2)
    plan = json.loads((tmp_path / "time_budget.json").read_text())
    assert plan == first["time_budget"]
    assert plan["train_seconds"] == pytest.approx(25 - plan["calibration_s"], abs=0.1)
    assert plan["max_steps"] == int(plan["train_seconds"] / (plan["seconds_per_step"] * cfg.time_budget_margin))
    assert plan["max_steps"] > cfg.calibration_steps
    assert first["world_size"] == 2 and first["global_step"] == plan["max_steps"]
    assert first["stopped_by_time_limit"] is False
    assert not (tmp_path / "calibration").exists()
    again = accelerate_launch("evoharness.training.sft", spec, tmp_path, num_processes=2)
    assert again == first  # a finished run is not trained further (transformers would add a step)
    # killed after the checkpoint before the last: the re-run resumes from it, to the planned step
    last = tmp_path / "checkpoints" / f"checkpoint-{plan['max_steps']}"
    shutil.rmtree(last), (tmp_path / "result.json").unlink()
    second = accelerate_launch("evoharness.training.sft", spec, tmp_path, num_processes=2)
    assert second["time_budget"] == plan and second["resumed_from"] is not None
    assert second["resumed_from"] != str(last) and second["global_step"] == plan["max_steps"]


def test_time_budget_stops_both_processes_at_the_budget_when_the_plan_overruns_it(tmp_path, traces, base_model):
    """A plan that cannot fit (margin 0.25: four times the steps the calibration says fit) is cut by the guard at
    the budget: both DDP processes stop after the same step (rank 0 decides; a split stop would hang the
    all-reduce), the final model is saved, and the result says the time limit stopped it."""
    cfg = SFTStageConfig(time_budget_s=12, calibration_steps=6, time_budget_margin=0.25,
                         per_device_train_batch_size=1, save_steps=10 ** 6, num_processes=2)
    spec = {"model_path": base_model, "train_file": str(traces / "train.jsonl"), "output_dir": str(tmp_path),
            "sft": dataclasses.asdict(cfg)}
    result = accelerate_launch("evoharness.training.sft", spec, tmp_path, num_processes=2)
    plan = result["time_budget"]
    assert result["stopped_by_time_limit"] is True
    assert 0 < result["global_step"] < plan["max_steps"]
    assert result["train_runtime_s"] < plan["train_seconds"] + 5
    assert (Path(result["final_path"]) / "config.json").exists()


@pytest.mark.parametrize("avx512_bf16, amx, expected",
                         [(True, False, True), (False, True, True), (False, False, False)])
def test_bf16_only_where_the_cpu_computes_it(monkeypatch, avx512_bf16, amx, expected):
    """``sft.bf16`` trains in bf16 on a CPU with AVX512-BF16 or AMX; elsewhere in fp32, with the reason recorded
    (emulated bf16 ran 23 times slower than fp32 on this project's AVX2 machines)."""
    import torch

    from evoharness.training.sft import training_precision

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    use_bf16, reason = training_precision(True)
    assert use_bf16 is expected
    assert reason.startswith("bf16 (CPU autocast" if expected else "fp32: bf16 asked, but this CPU")
    assert training_precision(False) == (False, "fp32 (config: bf16 false)")


def test_sft_records_its_precision(tmp_path, traces, base_model):
    """A run asking for bf16 on this machine's CPU records what it trained in (``precision``), bf16 or fp32."""
    from evoharness.training.sft import training_precision

    spec = {"model_path": base_model, "train_file": str(traces / "train.jsonl"), "output_dir": str(tmp_path),
            "sft": dataclasses.asdict(SFTStageConfig(max_steps=1, per_device_train_batch_size=1, bf16=True))}
    result = accelerate_launch("evoharness.training.sft", spec, tmp_path, num_processes=1)
    assert result["global_step"] == 1
    assert result["precision"] == training_precision(True)[1]  # model_dtype float32: nothing appended
