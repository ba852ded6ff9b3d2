"""The embedded default policy: a small Qwen3-architecture model built from a config, with a byte-level BPE
tokenizer trained on our own trace corpus and the Qwen3 chat template with its tool-call format.

Any other model (a local folder or a hub id such as ``Qwen/Qwen3-8B``) goes through the same ``load_policy``.
"""

from __future__ import annotations

import json
from pathlib import Path

from evoharness.config import PIECES, ModelConfig

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
                "<tools>", "</tools>"]


def qwen3_chat_template() -> str:
    """TRL's copy of the Qwen3 chat template (``trl/chat_templates/qwen3.jinja``), unchanged, so that
    ``trl.chat_template_utils.add_response_schema`` recognises it."""
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text()


def train_tokenizer(texts, vocab_size: int, pieces: str = "words-apart"):
    """Train a byte-level BPE tokenizer (``tokenizers``) on ``texts`` and wrap it as a transformers tokenizer with
    the Qwen3 special tokens and chat template (``../shared/FIELD-NOTES.md``). Pieces are split by the pattern
    ``PIECES[pieces]`` (either way a name is the same token ids wherever it stands), then byte-level encoded; the
    pattern is saved in ``tokenizer.json``, so a model loaded by path tokenizes as it was trained.

    Raises ValueError for a ``pieces`` not in ``PIECES``."""
    if pieces not in PIECES:
        raise ValueError(f"model.pieces is {pieces!r}; use one of {sorted(PIECES)}")
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PIECES[pieces]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS + ADDED_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIAL_TOKENS[1:])
    fast.add_tokens(ADDED_TOKENS)
    fast.chat_template = qwen3_chat_template()
    return fast


def build_default_model(cfg: ModelConfig, trace_file: str | Path, out_dir: str | Path) -> str:
    """Train the tokenizer on the rendered traces of ``trace_file`` (either context layout) and build a randomly
    initialised ``Qwen3ForCausalLM`` from ``cfg``; save both with ``save_pretrained`` under ``out_dir``. Returns the
    path."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    rows = [json.loads(line) for line in Path(trace_file).read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{trace_file}: no traces to train the tokenizer on (did collection win any episode?)")
    from transformers import PreTrainedTokenizerFast
    from trl.chat_template_utils import get_training_chat_template

    bootstrap = PreTrainedTokenizerFast(tokenizer_object=_whitespace_tokenizer())
    bootstrap.chat_template = qwen3_chat_template()
    # Train on the text SFT will see: TRL's training variant of the template (every assistant turn opens with
    # "<think>\n\n</think>\n\n"), so the BPE merges cover that scaffolding.
    training_template = get_training_chat_template(bootstrap) or bootstrap.chat_template
    texts = [bootstrap.apply_chat_template(conversation(r), tools=json.loads(r["tools"]) if r.get("tools") else None,
                                           tokenize=False, chat_template=training_template) for r in rows]
    tokenizer = train_tokenizer(texts, cfg.vocab_size, cfg.pieces)
    torch.manual_seed(cfg.seed)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen3ForCausalLM(config)
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def conversation(row: dict) -> list[dict]:
    """A trace row's messages: ``messages`` (history context) or ``prompt`` + ``completion`` (turn context)."""
    return row["messages"] if "messages" in row else row["prompt"] + row["completion"]


def _whitespace_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def load_policy(path: str, dtype: str = "float32"):
    """Load (model, tokenizer) from a local folder or hub id with ``AutoModelForCausalLM``/``AutoTokenizer``.

    The tokenizer must carry a chat template with tool calls (Qwen3's). Raises OSError from transformers when the
    path is neither a folder nor a reachable hub id.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return model, tokenizer


def num_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def lora_config(cfg):
    """peft ``LoraConfig`` for a causal LM from a stage's ``TrainingRuntime`` settings (``lora_r``, ``lora_alpha``,
    ``lora_dropout``, ``lora_target_modules``; Hu et al. 2021, arXiv:2106.09685), or None when ``lora_r`` is 0 (full
    fine-tuning). TRL's trainers take it as ``peft_config``."""
    if cfg.lora_r <= 0:
        return None
    from peft import LoraConfig

    return LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=cfg.lora_target_modules, task_type="CAUSAL_LM")


def save_final(trainer, tokenizer, final: str | Path, merge_lora: bool, layout: str | None = None) -> None:
    """Save a TRL trainer's model to ``final`` as one plain model folder every later stage loads by path.

    ``merge_lora``: the model is a peft LoRA model (trained under DDP, every rank holds the whole model): rank 0
    merges the adapter into the base weights (``merge_and_unload``) and saves. Otherwise ``trainer.save_model`` on
    every rank (under FSDP it gathers the full state dict; rank 0 writes). ``layout``: stored in the config as
    ``evoharness_layout`` (the prompt layout the model was trained on)."""
    if merge_lora:
        trainer.accelerator.wait_for_everyone()
        if trainer.accelerator.is_main_process:
            merged = trainer.accelerator.unwrap_model(trainer.model).merge_and_unload()
            if layout:
                merged.config.evoharness_layout = layout
            merged.save_pretrained(str(final))
    else:
        if layout:
            trainer.model.config.evoharness_layout = layout
        trainer.save_model(str(final))
    if trainer.accelerator.is_main_process:
        tokenizer.save_pretrained(str(final))
