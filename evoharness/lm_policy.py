"""A causal language model as the policy, acting through the Qwen3 chat/tool-call format.

The policy keeps the whole episode as one token sequence: the prompt (system + tools + first observation), then
per turn the tokens it generated (``env_mask`` 1) and the tool response the loop appended (``env_mask`` 0). That
sequence is exactly what GRPO trains on (TRL's ``rollout_func`` contract: ``prompt_ids``, ``completion_ids``,
``logprobs``, ``env_mask``), so rollouts are on-policy token for token.
"""

from __future__ import annotations

import torch

from evoharness.agent import Decision, parse_tool_call


class LMPolicy:
    """Sampling (``temperature`` > 0) or greedy policy over a transformers causal LM.

    Args:
        model, tokenizer: from ``evoharness.model.load_policy``.
        max_new_tokens: per turn; a turn that reaches it without ``<|im_end|>`` is closed by the loop.
        temperature: 0 = greedy.
        max_context: the episode ends (as truncated) once the sequence would exceed it.
    """

    def __init__(self, model, tokenizer, max_new_tokens: int = 48, temperature: float = 0.0,
                 max_context: int | None = None):
        self.model, self.tok = model, tokenizer
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.max_context = max_context or getattr(model.config, "max_position_embeddings", 4096)
        self.end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def start(self, messages: list[dict], tools: list[dict]) -> None:
        text = self.tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        self.prompt_ids: list[int] = self.tok(text, add_special_tokens=False)["input_ids"]
        self.completion_ids: list[int] = []
        self.env_mask: list[int] = []
        self.logprobs: list[float] = []
        self.generated_tokens = 0
        self.truncated = False

    @torch.no_grad()
    def decide(self, state: dict) -> Decision:
        """Generate one assistant turn and parse its tool call. Malformed output is returned as
        ``Decision(None, {}, malformed=True, text=...)``; the loop maps its text to an admissible command."""
        ids = self.prompt_ids + self.completion_ids
        if len(ids) + self.max_new_tokens > self.max_context:
            self.truncated = True
            return Decision(None, {}, malformed=True, text="look")
        inputs = torch.tensor([ids], device=self.model.device)
        sample = self.temperature > 0
        out = self.model.generate(
            input_ids=inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=self.max_new_tokens,
            do_sample=sample, temperature=self.temperature if sample else None, top_k=0 if sample else None,
            top_p=1.0 if sample else None, eos_token_id=self.end_id, pad_token_id=self.tok.pad_token_id,
            output_scores=True, return_dict_in_generate=True)
        gen = out.sequences[0, len(ids):].tolist()
        scores = self.model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)[0].tolist()
        if self.end_id in gen:
            cut = gen.index(self.end_id) + 1
            gen, scores = gen[:cut], scores[:cut]
        self.completion_ids += gen
        self.env_mask += [1] * len(gen)
        self.logprobs += scores
        self.generated_tokens += len(gen)
        if not gen or gen[-1] != self.end_id:  # close the turn as the environment would
            self._append_env([self.end_id])
        text = self.tok.decode(gen, skip_special_tokens=False)
        name, args = parse_tool_call(text)
        if name is None:
            stripped = text.replace("<|im_end|>", "").split("</think>")[-1].strip()
            return Decision(None, {}, malformed=True, text=stripped)
        return Decision(name, args, text=text)

    def observe(self, text: str) -> None:
        """Append the tool response and the next generation prompt (Qwen3 template layout)."""
        suffix = f"\n<|im_start|>user\n<tool_response>\n{text}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        self._append_env(self.tok(suffix, add_special_tokens=False)["input_ids"])

    def _append_env(self, ids: list[int]) -> None:
        self.completion_ids += ids
        self.env_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def rollout(self) -> dict:
        """The episode as TRL's ``rollout_func`` expects one entry, trailing environment tokens removed."""
        n = len(self.env_mask)
        while n and self.env_mask[n - 1] == 0:
            n -= 1
        return {"prompt_ids": self.prompt_ids, "completion_ids": self.completion_ids[:n],
                "logprobs": self.logprobs[:n], "env_mask": self.env_mask[:n]}
