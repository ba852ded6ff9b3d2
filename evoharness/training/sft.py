"""Supervised harness fine-tuning with TRL's ``SFTTrainer`` (loss on assistant turns only).

Run it through Accelerate, as TRL's docs do::

    accelerate launch --config_file accelerate/cpu_1proc.yaml -m evoharness.training.sft --spec spec.json

``spec.json`` holds ``model_path``, ``train_file``, ``valid_file``, ``output_dir`` and the ``SFTStageConfig``
fields under ``sft``. Checkpoints go to ``output_dir/checkpoints``; a re-run resumes from the last one (same step
counter and optimizer state). The final model is saved to ``output_dir/final``. When ``MLFLOW_RUN_ID`` is set,
loss and learning rate are logged to that run by transformers' MLflow callback.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

from transformers import TrainerCallback

from evoharness.config import SFTStageConfig


def load_trace_dataset(path: str | Path):
    """The trace JSONL as a ``datasets.Dataset`` with the columns TRL reads: ``messages`` (+ ``tools``) for
    history-context traces (conversational language modelling), ``prompt`` + ``completion`` (+ ``tools``) for
    turn-context traces (conversational prompt-completion: TRL computes the loss on the completion only)."""
    from datasets import load_dataset

    ds = load_dataset("json", data_files=str(path), split="train")
    return ds.remove_columns([c for c in ds.column_names if c not in ("messages", "prompt", "completion", "tools")])


def training_precision(bf16: bool) -> tuple[bool, str]:
    """Whether to train in bf16 when the config asks for ``bf16``, and a one-line reason for the run's record.

    bf16 runs on a CUDA device that supports it, or on a CPU that computes it natively (AVX512-BF16 or AMX tiles:
    ``torch.cpu._is_avx512_bf16_supported`` / ``_is_amx_tile_supported``). Elsewhere torch emulates bf16 autocast,
    and training ran 23 times slower than in fp32 (measured 2026-12-02/03 on a 2-core AVX2 ``AMD EPYC``, the
    ``full-parallel`` step of 32 examples: 52.6 s in bf16, 2.26 s in fp32, 1.37 s in bf16 with AVX512-BF16), so the
    run trains in fp32 instead and says so. Returns ``(use_bf16, reason)``; never raises."""
    import torch

    if not bf16:
        return False, "fp32 (config: bf16 false)"
    if torch.cuda.is_available():
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return True, "bf16 (CUDA)"
        return False, "fp32: bf16 asked, but this GPU has no native bf16 (before Ampere)"
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    native = any(getattr(torch.cpu, name, lambda: False)() for name in checks)
    if native:
        return True, "bf16 (CPU autocast, AVX512-BF16/AMX)"
    capability = torch.backends.cpu.get_cpu_capability()
    return False, f"fp32: bf16 asked, but this CPU ({capability}) has no AVX512-BF16 or AMX, where bf16 is emulated"


class StepClock(TrainerCallback):
    """Times every optimizer step of the run, so the result can give the steady rate apart from the start-up (data
    loading, ``torch.compile``'s compilation, the first allocations).

    ``steady(skip)`` -> ``(seconds_per_step, tokens_per_s, steps)`` over the steps after the first ``skip`` of this
    run (tokens: the trainer's non-padding ``num_input_tokens_seen``, summed over processes); ``(None, None, 0)``
    when fewer than two steps remain."""

    def __init__(self):
        self.marks: list[tuple[float, int]] = []  # (time.perf_counter() s, tokens seen) at each step's end

    def on_step_end(self, args, state, control, **kwargs):
        self.marks.append((time.perf_counter(), state.num_input_tokens_seen))

    def steady(self, skip: int) -> tuple[float | None, float | None, int]:
        marks = self.marks[skip:]
        if len(marks) < 2:
            return None, None, 0
        (t0, k0), (t1, k1) = marks[0], marks[-1]
        steps = len(marks) - 1
        return (t1 - t0) / steps, (k1 - k0) / max(t1 - t0, 1e-9), steps


class TrainSeconds(TrainerCallback):
    """Training wall seconds over every launch of a run: the total recorded in the checkpoint it resumes from plus
    this launch's. Each checkpoint keeps the running total (``train_seconds.json``), so a killed launch's training
    up to its last checkpoint is counted (what it trained after it is lost and trained again, and counted again).

    ``before``: seconds recorded in ``resumed_from`` (0.0 for a fresh run or a checkpoint without the file);
    ``total()``: ``before`` plus the seconds since this launch's training began."""

    FILE = "train_seconds.json"

    def __init__(self, resumed_from: str | None):
        self.before, self.start = 0.0, None
        try:
            self.before = float(json.loads((Path(resumed_from) / self.FILE).read_text())["train_seconds"])
        except (TypeError, OSError, ValueError, KeyError):
            pass

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def total(self) -> float:
        return self.before + (time.perf_counter() - self.start if self.start is not None else 0.0)

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if state.is_world_process_zero and folder.is_dir():
            (folder / self.FILE).write_text(json.dumps({"train_seconds": round(self.total(), 3),
                                                        "global_step": state.global_step}))


class TimeLimit(TrainerCallback):
    """Stops training (``control.should_training_stop``; the final model is still saved) once rank 0 has trained
    ``seconds`` of wall time: the guard behind ``sft.time_budget_s``, whose step count is planned to end before it.

    Rank 0's clock decides for every process (a one-element broadcast after each step), so all stop after the same
    step: a process that went one step further would wait forever in DDP's gradient all-reduce. ``hit`` says
    whether the guard stopped the run."""

    def __init__(self, seconds: float):
        self.seconds, self.start, self.hit = seconds, None, False

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.start is None:
            return
        over = time.perf_counter() - self.start > self.seconds
        if args.world_size > 1:
            import torch
            from accelerate.utils import broadcast

            from accelerate import PartialState

            over = bool(broadcast(torch.tensor([int(over)], device=PartialState().device), from_process=0).item())
        if over:
            self.hit = control.should_training_stop = True


def _budget_steps(cfg: SFTStageConfig, output_dir: Path, calibration_trainer) -> dict:
    """The step count that fits ``cfg.time_budget_s`` on this machine, measured: ``cfg.calibration_steps`` steps of
    the same recipe on a throwaway copy of the model (``calibration_trainer(steps, out_dir)`` builds its trainer),
    then ``max_steps = (time_budget_s - calibration wall s) / (steady s a step x time_budget_margin)``.

    The plan is kept in ``output_dir/time_budget.json`` and read back by a resumed run, so a re-run trains to the
    same step counter and schedule. Every process measures; rank 0's plan is broadcast, so all agree.
    Returns ``{"max_steps", "train_seconds", "seconds_per_step", "calibration_s", ...}``.
    Raises ValueError when the calibration leaves no time to train."""
    plan_file = output_dir / "time_budget.json"
    if plan_file.exists():
        return json.loads(plan_file.read_text())
    from accelerate.utils import broadcast_object_list

    t0 = time.perf_counter()
    trainer = calibration_trainer(cfg.calibration_steps, output_dir / "calibration")
    clock = StepClock()
    trainer.add_callback(clock)
    trainer.train()
    step_s, tokens_per_s, steps = clock.steady(skip=max(1, len(clock.marks) // 5))
    del trainer
    if int(os.environ.get("RANK", "0")) == 0:
        shutil.rmtree(output_dir / "calibration", ignore_errors=True)
    calibration_s = time.perf_counter() - t0
    train_seconds = cfg.time_budget_s - calibration_s
    plan = [{"time_budget_s": cfg.time_budget_s, "calibration_steps": cfg.calibration_steps,
             "calibration_s": round(calibration_s, 1), "seconds_per_step": step_s, "tokens_per_s": tokens_per_s,
             "margin": cfg.time_budget_margin, "train_seconds": train_seconds,
             "max_steps": int(train_seconds / (step_s * cfg.time_budget_margin)) if step_s else 0}]
    broadcast_object_list(plan, from_process=0)
    plan = plan[0]
    if plan["max_steps"] < 1:
        raise ValueError(f"sft.time_budget_s {cfg.time_budget_s}: the {cfg.calibration_steps}-step calibration took "
                         f"{calibration_s:.0f} s and left no time to train; raise the budget or lower "
                         "sft.calibration_steps")
    if int(os.environ.get("RANK", "0")) == 0:
        plan_file.write_text(json.dumps(plan, indent=1))
        print(f"evoharness.training.sft: time budget {cfg.time_budget_s:.0f} s -> {plan['max_steps']} steps "
              f"({step_s:.3f} s a step over {steps} calibration steps, {tokens_per_s:.0f} tokens/s, margin "
              f"{cfg.time_budget_margin})", flush=True)
    return plan


def train_sft(model_path: str, train_file: str, output_dir: str, cfg: SFTStageConfig,
              valid_file: str | None = None, layout: dict | None = None) -> dict:
    """Fine-tune ``model_path`` on the traces; returns ``{"final_path", "global_step", "train_loss", ...}``.

    ``layout`` (``evoharness.harness.context.layout_of``) is saved in the final model's ``config.json`` as
    ``evoharness_layout``, so evaluation prompts the model the way it was trained.

    ``cfg.bf16`` trains in bf16 only where the hardware computes it (``training_precision``); the result's
    ``precision`` says what the run used.

    Raises ValueError when the training file holds no traces.
    """
    from transformers.trainer_utils import get_last_checkpoint
    from trl import SFTConfig, SFTTrainer

    from evoharness.training.model import load_policy, lora_config, save_final

    train = load_trace_dataset(train_file)
    if len(train) == 0:
        raise ValueError(f"{train_file}: no traces to train on")
    valid = load_trace_dataset(valid_file) if valid_file and Path(valid_file).stat().st_size else None
    import torch

    model, tokenizer = load_policy(model_path, dtype=cfg.model_dtype)
    use_bf16, precision = training_precision(cfg.bf16)
    if cfg.model_dtype != "float32":
        precision += f"; weights in {cfg.model_dtype}"
    if cfg.bf16 and not use_bf16 and int(os.environ.get("RANK", "0")) == 0:
        print(f"evoharness.training.sft: {precision}", flush=True)
    peft_config = lora_config(cfg)
    ckpt_dir = Path(output_dir) / "checkpoints"

    def make_trainer(model, max_steps: int, out_dir: Path, report: bool, save_steps: int, evaluate: bool):
        args = SFTConfig(
            output_dir=str(out_dir), assistant_only_loss="messages" in train.column_names, max_length=cfg.max_length,
            num_train_epochs=cfg.num_train_epochs, max_steps=max_steps,
            per_device_train_batch_size=cfg.per_device_train_batch_size,
            gradient_accumulation_steps=cfg.gradient_accumulation_steps, learning_rate=cfg.learning_rate,
            lr_scheduler_type="cosine", warmup_steps=cfg.warmup_ratio, logging_steps=cfg.logging_steps,
            save_steps=save_steps, save_total_limit=2, seed=cfg.seed, use_cpu=not torch.cuda.is_available(),
            bf16=use_bf16, torch_compile=cfg.torch_compile,
            activation_checkpointing=cfg.gradient_checkpointing,  # transformers 5 name (the old one warns)
            # every parameter takes part in each forward pass (full fine-tuning, or LoRA's adapters): DDP need not
            # search the graph for unused ones, which costs a traversal a step and printed a notice per process
            ddp_find_unused_parameters=False,
            report_to=["mlflow"] if report and os.environ.get("MLFLOW_RUN_ID") else "none",
            eval_strategy="epoch" if evaluate and valid is not None else "no",
            per_device_eval_batch_size=cfg.per_device_train_batch_size,
            dataloader_num_workers=0, disable_tqdm=False, train_sampling_strategy=cfg.sampling,
            include_num_input_tokens_seen="non_padding",
        )
        return SFTTrainer(model=model, args=args, train_dataset=train, eval_dataset=valid if evaluate else None,
                          processing_class=tokenizer, peft_config=peft_config)

    max_steps, budget = cfg.max_steps, None
    if cfg.time_budget_s > 0:
        budget = _budget_steps(cfg, Path(output_dir), lambda steps, out: make_trainer(
            load_policy(model_path, dtype=cfg.model_dtype)[0], steps, out, False, 10 ** 9, False))
        max_steps = budget["max_steps"]
    done = _finished_result(Path(output_dir), max_steps, cfg.num_train_epochs)
    if done is not None:  # transformers trains one more step when resumed from the last one; nothing to do here
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"evoharness.training.sft: {output_dir} already trained to step {done['global_step']}; its final "
                  f"model {done['final_path']} is kept (delete result.json to train it again)", flush=True)
        return done
    trainer = make_trainer(model, max_steps, ckpt_dir, True, cfg.save_steps, True)
    clock = StepClock()
    trainer.add_callback(clock)
    last = get_last_checkpoint(str(ckpt_dir)) if ckpt_dir.exists() else None
    seconds = TrainSeconds(last)
    trainer.add_callback(seconds)
    # the budget covers the whole training: a resumed launch gets what its earlier launches left of it
    limit = TimeLimit(budget["train_seconds"] - seconds.before) if budget is not None else None
    if limit is not None:
        trainer.add_callback(limit)
    result = trainer.train(resume_from_checkpoint=last)
    final = Path(output_dir) / "final"
    save_final(trainer, tokenizer, final, merge_lora=peft_config is not None, layout=layout)
    history = [h for h in trainer.state.log_history if "loss" in h]
    step_s, steady_tps, steady_steps = clock.steady(skip=max(1, len(clock.marks) // 10))
    return {"final_path": str(final), "global_step": trainer.state.global_step,
            "train_loss": result.training_loss, "first_loss": history[0]["loss"] if history else None,
            "last_loss": history[-1]["loss"] if history else None, "resumed_from": last,
            "world_size": trainer.accelerator.num_processes, "train_rows": len(train),
            # every launch's training seconds (TrainSeconds); launch_runtime_s: this launch's alone
            "train_runtime_s": round(seconds.before + (result.metrics.get("train_runtime") or 0.0), 3),
            "launch_runtime_s": result.metrics.get("train_runtime"), "earlier_launches_s": seconds.before,
            "tokens_seen": trainer.state.num_input_tokens_seen, "precision": precision,
            "torch_compile": cfg.torch_compile,
            # steady rate: this run's steps after its first tenth (start-up and compilation left out)
            "steady_seconds_per_step": step_s, "steady_tokens_per_s": steady_tps, "steady_steps": steady_steps,
            "time_budget": budget, "stopped_by_time_limit": bool(limit and limit.hit),
            "max_steps": max_steps, "num_train_epochs": cfg.num_train_epochs}


def _finished_result(output_dir: Path, max_steps: int, num_train_epochs: float) -> dict | None:
    """The result of a run in ``output_dir`` that already finished what ``max_steps``/``num_train_epochs`` ask
    (its ``result.json`` asked the same and its final model is saved), else None: a re-run returns it instead of
    resuming from the last checkpoint (transformers would train one step past the end)."""
    try:
        prev = json.loads((output_dir / "result.json").read_text())
    except (OSError, ValueError):
        return None
    same = prev.get("max_steps") == max_steps and prev.get("num_train_epochs") == num_train_epochs
    return prev if same and (Path(prev.get("final_path", "")) / "config.json").exists() else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spec", required=True, help="JSON file: model_path, train_file, output_dir, sft")
    spec = json.loads(Path(parser.parse_args(argv).spec).read_text())
    out = train_sft(spec["model_path"], spec["train_file"], spec["output_dir"], SFTStageConfig(**spec["sft"]),
                    spec.get("valid_file"), spec.get("layout"))
    if int(os.environ.get("RANK", "0")) == 0:
        Path(spec["output_dir"], "result.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
