"""Supervised harness fine-tuning with TRL's ``SFTTrainer`` (loss on assistant turns only).

Run it through Accelerate, as TRL's docs do::

    accelerate launch --config_file accelerate/cpu_1proc.yaml -m evoharness.sft --spec spec.json

``spec.json`` holds ``model_path``, ``train_file``, ``valid_file``, ``output_dir`` and the ``SFTStageConfig``
fields under ``sft``. Checkpoints go to ``output_dir/checkpoints``; a re-run resumes from the last one (same step
counter and optimizer state). The final model is saved to ``output_dir/final``. When ``MLFLOW_RUN_ID`` is set,
loss and learning rate are logged to that run by transformers' MLflow callback.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

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


def train_sft(model_path: str, train_file: str, output_dir: str, cfg: SFTStageConfig,
              valid_file: str | None = None, layout: dict | None = None) -> dict:
    """Fine-tune ``model_path`` on the traces; returns ``{"final_path", "global_step", "train_loss", ...}``.

    ``layout`` (``evoharness.context.layout_of``) is saved in the final model's ``config.json`` as
    ``evoharness_layout``, so evaluation prompts the model the way it was trained.

    ``cfg.bf16`` trains in bf16 only where the hardware computes it (``training_precision``); the result's
    ``precision`` says what the run used.

    Raises ValueError when the training file holds no traces.
    """
    from transformers.trainer_utils import get_last_checkpoint
    from trl import SFTConfig, SFTTrainer

    from evoharness.model import load_policy, lora_config, save_final

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
        print(f"evoharness.sft: {precision}", flush=True)
    peft_config = lora_config(cfg)
    ckpt_dir = Path(output_dir) / "checkpoints"
    args = SFTConfig(
        output_dir=str(ckpt_dir), assistant_only_loss="messages" in train.column_names, max_length=cfg.max_length,
        num_train_epochs=cfg.num_train_epochs, max_steps=cfg.max_steps,
        per_device_train_batch_size=cfg.per_device_train_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps, learning_rate=cfg.learning_rate,
        lr_scheduler_type="cosine", warmup_steps=cfg.warmup_ratio, logging_steps=cfg.logging_steps,
        save_steps=cfg.save_steps, save_total_limit=2, seed=cfg.seed, use_cpu=not torch.cuda.is_available(),
        bf16=use_bf16,
        gradient_checkpointing=cfg.gradient_checkpointing,
        report_to=["mlflow"] if os.environ.get("MLFLOW_RUN_ID") else "none",
        eval_strategy="epoch" if valid is not None else "no",
        per_device_eval_batch_size=cfg.per_device_train_batch_size,
        dataloader_num_workers=0, disable_tqdm=False, train_sampling_strategy=cfg.sampling,
        include_num_input_tokens_seen="non_padding",
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=train, eval_dataset=valid, processing_class=tokenizer,
                         peft_config=peft_config)
    last = get_last_checkpoint(str(ckpt_dir)) if ckpt_dir.exists() else None
    result = trainer.train(resume_from_checkpoint=last)
    final = Path(output_dir) / "final"
    save_final(trainer, tokenizer, final, merge_lora=peft_config is not None, layout=layout)
    history = [h for h in trainer.state.log_history if "loss" in h]
    return {"final_path": str(final), "global_step": trainer.state.global_step,
            "train_loss": result.training_loss, "first_loss": history[0]["loss"] if history else None,
            "last_loss": history[-1]["loss"] if history else None, "resumed_from": last,
            "world_size": trainer.accelerator.num_processes, "train_rows": len(train),
            "train_runtime_s": result.metrics.get("train_runtime"),
            "tokens_seen": trainer.state.num_input_tokens_seen, "precision": precision}


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
