"""A causal language model as the policy, acting through the Qwen3 chat/tool-call format.

In the ``history`` context the policy keeps the whole episode as one token sequence: the prompt (system + tools +
first observation), then per turn the tokens it generated (``env_mask`` 1) and the tool response the loop appended
(``env_mask`` 0); ``rollout()`` returns it as one entry of TRL's ``rollout_func`` contract (``prompt_ids``,
``completion_ids``, ``logprobs``, ``env_mask``). In the ``turn`` context every turn has its own prompt, and
``turns`` holds one such entry per turn: the prompt the policy read and the tokens it produced.
"""

from __future__ import annotations

import re

import torch

from evoharness.policy.agent import Decision, parse_tool_call, parse_tool_calls

EMPTY_THINK = "<think>\n\n</think>\n\n"  # what the Qwen3 training template puts before every assistant turn
ACT_PREFIX = '<tool_call>\n{"name": "act", "arguments": {"command": "'
COMMAND_OPEN = '"command": "'
COMMAND_CLOSE = '"}}\n</tool_call>'
ENTITY_OPEN = '"entity": "'  # track's first argument (the only tool with an "entity" or a "value")
ENTITY_CLOSE = '", "attribute": "'
VALUE_OPEN = '"value": "'
LOCATION = '"attribute": "location"'
NAME = re.compile(r"\b[a-z]+ \d+\b")  # an ALFWorld object or receptacle name: "cd 3", "drawer 12"


class LMPolicy:
    """Sampling (``temperature`` > 0) or greedy policy over a transformers causal LM.

    Args:
        model, tokenizer: from ``evoharness.training.model.load_policy``.
        max_new_tokens: per turn; a turn that reaches it without ``<|im_end|>`` is closed by the loop.
        temperature: 0 = greedy.
        max_context: the episode ends (as truncated) once the sequence would exceed it.
        context: ``history`` (one growing token sequence per episode, kept for GRPO) or ``turn`` (each turn a
            fresh prompt from ``state["turn_messages"]``, see ``evoharness.harness.context``).
        decoding: ``remap`` (the loop maps the generated command to the closest admissible one) or ``score``
            (``turn`` context): generation stops once an ``act`` call opens its command string, and the command
            is the admissible one with the highest log-likelihood, closing quote included; malformed output is
            scored as an ``act`` call too. Every executed command is then admissible by construction.
        tools: the tool schemas rendered into a ``turn`` prompt (None: left out, ``TraceConfig.tools_in_prompt``).
        chunk: candidates scored per forward pass.
        act_each_turn: ``score`` decoding in the ``parallel_calls`` layout, where every turn but the closing ``note``
            ends with its ``act`` (a training turn without one is a state whose command was not a target, e.g. a
            perturbed random step). When the generated turn holds complete meta-action calls but no act (it closed
            with ``<|im_end|>``, ran out of ``max_new_tokens``, or its last block was ill-formed), the act is scored
            right after its last complete call, so the turn still moves the episode. Off, such a turn is
            meta-actions only, and a policy that answers a prompt with meta-actions alone can replay them until the
            meta-action budget is spent without a step (``full-parallel``: 23 of 140 ``valid_seen`` episodes). The
            turn on which ``state["closing"]`` is set (the episode's last, only ``note`` runs) is left as generated.
        generate_fn: another generation backend, ``(prompt ids, max_new_tokens) -> (generated ids, their
            log-probabilities)`` for one sampled turn, e.g. TRL's vLLM engine during GRPO
            (``evoharness.training.rollouts.vllm_generate_fn``). It need not stop at ``<|im_end|>`` or at the command
            opening that score decoding stops at: the turn is cut here, as ``model.generate``'s stop strings would cut
            it. Candidate scoring still runs on ``model``.
        engine: an ``evoharness.policy.batching.BatchEngine`` shared with the other episodes of this process: generation
            and candidate scoring become its requests, which reuse the KV caches of this episode's earlier calls
            (``generate_fn`` still wins for generation). None: this policy's own calls on ``model``.

        ground_track: ``score`` decoding: a ``track`` call's ``entity`` is scored (as an act's command is) over the
            object and receptacle names ("cd 3") in ``state["observation"]``, the latest observation, and the
            ``value`` of a ``location`` fact over those names and "inventory"; every other token is generated. The
            teacher's facts are all of that form (``full-parallel`` traces: 10,432 of 10,432 track calls of the first
            20,000 training turns), so this only rules out names the policy has not just read, e.g. "cd 3 location
            inventory" after "You pick up the pencil 3". A latest observation with no name leaves the call generated.

    In the ``turn`` context with ``score`` decoding, ``state["force_act"]`` (set by ``run_episode`` when a turn left
    the prompt unchanged) skips generation and scores the admissible commands right away (counted in ``forced``).
    """

    def __init__(self, model, tokenizer, max_new_tokens: int = 48, temperature: float = 0.0,
                 max_context: int | None = None, context: str = "history", decoding: str = "remap",
                 tools: list[dict] | None = None, chunk: int = 16, generate_fn=None, act_each_turn: bool = False,
                 ground_track: bool = False, engine=None):
        if decoding == "score" and context != "turn":
            raise ValueError("decoding 'score' needs the turn context (traces.context: turn)")
        self.model, self.tok = model, tokenizer
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.max_context = max_context or getattr(model.config, "max_position_embeddings", 4096)
        self.end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.close_id = tokenizer.convert_tokens_to_ids("</tool_call>")
        self.context, self.decoding, self.tools, self.chunk = context, decoding, tools, chunk
        self.generate_fn = generate_fn
        self.engine = engine
        self.act_each_turn = act_each_turn
        self.ground_track = ground_track
        self.grounded = 0  # ground_track: track arguments scored over the observation's names
        self.scored = 0
        self.forced = 0
        self.appended = 0  # act_each_turn: acts scored after a generated turn of meta-actions only
        # the canonical opening of an act call up to its command string: forced and malformed turns are scored after it
        self.act_prefix_ids = tokenizer(EMPTY_THINK + ACT_PREFIX, add_special_tokens=False)["input_ids"]
        # an act opened after another call of the same turn (act_each_turn), as the chat template separates calls
        self.next_act_ids = tokenizer("\n" + ACT_PREFIX, add_special_tokens=False)["input_ids"]

    def start(self, messages: list[dict], tools: list[dict]) -> None:
        self.generated_tokens = 0
        self.truncated = False
        self.completion_ids: list[int] = []
        self.env_mask: list[int] = []
        self.logprobs: list[float] = []
        self.turns: list[dict] = []  # turn context: one entry per turn, see ``_record``
        self._anchor: str | None = None
        if self.context == "turn":
            self.prompt_ids: list[int] = []
            return
        text = self.tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        self.prompt_ids = self.tok(text, add_special_tokens=False)["input_ids"]

    @torch.no_grad()
    def decide(self, state: dict) -> Decision:
        """Generate one assistant turn and parse its tool call. Malformed output is returned as
        ``Decision(None, {}, malformed=True, text=...)``; the loop maps its text to an admissible command."""
        if self.context == "turn":
            return self._decide_turn(state)
        ids = self.prompt_ids + self.completion_ids
        if len(ids) + self.max_new_tokens > self.max_context:
            self.truncated = True
            return Decision(None, {}, malformed=True, text="look")
        gen, scores = self._generate(ids)
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

    def _generate(self, ids: list[int], stop_strings: list[str] | None = None,
                  max_new_tokens: int | None = None) -> tuple[list[int], list[float]]:
        """One assistant turn after ``ids`` with ``model.generate`` (greedy, or sampled at ``temperature`` with
        top-k/top-p off) or ``generate_fn``; returns the generated ids (at most ``max_new_tokens``, default the
        policy's), cut after ``<|im_end|>`` or after the first of ``stop_strings``, and their log-probabilities."""
        budget = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        if self.generate_fn is not None:
            gen, scores = self.generate_fn(ids, budget)
            gen, scores = list(gen)[:budget], list(scores)[:budget]
            if stop_strings:
                cut = next((k for k in range(1, len(gen) + 1)
                            if any(s in self.tok.decode(gen[:k], skip_special_tokens=False) for s in stop_strings)),
                           len(gen))
                gen, scores = gen[:cut], scores[:cut]
            return self._cut_at_end(gen, scores)
        if self.engine is not None:
            return self._cut_at_end(*self.engine.generate(ids, stop_strings, budget, self.temperature))
        inputs = torch.tensor([ids], device=self.model.device)
        sample = self.temperature > 0
        out = self.model.generate(
            input_ids=inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=budget,
            do_sample=sample, temperature=self.temperature if sample else None, top_k=0 if sample else None,
            top_p=1.0 if sample else None, eos_token_id=self.end_id, pad_token_id=self.tok.pad_token_id,
            stop_strings=stop_strings, tokenizer=self.tok if stop_strings else None,
            output_scores=True, return_dict_in_generate=True)
        gen = out.sequences[0, len(ids):].tolist()
        scores = self.model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)[0].tolist()
        return self._cut_at_end(gen, scores)

    def _cut_at_end(self, gen: list[int], scores: list[float]) -> tuple[list[int], list[float]]:
        if self.end_id in gen:
            cut = gen.index(self.end_id) + 1
            gen, scores = gen[:cut], scores[:cut]
        return gen, scores

    def _decide_turn(self, state: dict) -> Decision:
        self._anchor = state.get("observation")  # the turn's environment state, for step-level advantages
        text = self.tok.apply_chat_template(state["turn_messages"], tools=self.tools, add_generation_prompt=True,
                                            tokenize=False)
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) + self.max_new_tokens > self.max_context:
            self.truncated = True
            return Decision(None, {}, malformed=True, text="look")
        score = self.decoding == "score" and bool(state.get("admissible_commands"))
        prefix = self.act_prefix_ids if score else []
        if score and state.get("force_act"):  # the previous call changed nothing: act, scored as usual
            self.forced += 1
            return self._score_act(ids, prefix, [0.0] * len(prefix), [0] * len(prefix), state["admissible_commands"])
        if score and self.ground_track:
            gen, logps = self._generate_grounded(ids, state.get("observation") or "")
        else:
            gen, logps = self._generate(ids, [COMMAND_OPEN] if score else None)
        self.generated_tokens += len(gen)
        out = self.tok.decode(gen, skip_special_tokens=False)
        calls = parse_tool_calls(out)  # complete calls; parallel_calls: the meta-actions ahead of the act
        if score and out.rstrip("\n").endswith(COMMAND_OPEN) and '"act"' in out.rsplit("<tool_call>", 1)[-1]:
            dec = self._score_act(ids, gen, logps, [1] * len(gen), state["admissible_commands"], out)
            dec.before = calls
            return dec
        if score and calls and self.act_each_turn and not state.get("closing"):
            return self._append_act(ids, gen, logps, calls, state["admissible_commands"])
        self._record(ids, gen, logps, [1] * len(gen))
        if calls:
            return Decision(*calls[-1], text=out, before=calls[:-1])
        if score:  # malformed: still an admissible act, scored after the canonical act prefix
            dec = self._score_act(ids, prefix, [0.0] * len(prefix), [0] * len(prefix), state["admissible_commands"],
                                  out, record=False)  # the turn recorded is the sampled (malformed) text
            dec.malformed = True
            return dec
        stripped = out.replace("<|im_end|>", "").split("</think>")[-1].strip()
        return Decision(None, {}, malformed=True, text=stripped)

    def _generate_grounded(self, ids: list[int], observation: str) -> tuple[list[int], list[float]]:
        """``ground_track``: generate the turn after ``ids`` as ``_generate`` does (stopping where an act's command
        opens), but stop also wherever a ``"entity": "`` or a ``"value": "`` opens. In a ``track`` call, the entity,
        and the value of a ``location`` fact, are then the candidate name (with the text that follows it in
        training) that ``_choose`` picks from the observation's names; at any other such stop (a ``state`` or
        ``searched`` value) generation goes on. A name that would not fit in ``max_new_tokens`` is not scored: the
        turn ends there, as a turn that runs out of tokens does. Returns the turn's ids and log-probabilities, the
        scored pieces included (each prompt is encoded again at every stop)."""
        names = list(dict.fromkeys(NAME.findall(observation)))
        if not names:  # nothing to ground on ("Nothing happens."): the turn as _generate gives it
            return self._generate(ids, [COMMAND_OPEN])
        gen: list[int] = []
        logps: list[float] = []
        while len(gen) < self.max_new_tokens:
            g, lp = self._generate(ids + gen, [COMMAND_OPEN, ENTITY_OPEN, VALUE_OPEN], self.max_new_tokens - len(gen))
            gen, logps = gen + g, logps + lp
            if not g or g[-1] == self.end_id:
                break
            out = self.tok.decode(gen, skip_special_tokens=False)
            block = out.rsplit("<tool_call>", 1)[-1]
            if '"name": "act"' in block or out.rstrip("\n").endswith(COMMAND_OPEN):
                break  # an act's command opened: the caller scores it
            if '"name": "track"' in block and out.endswith(ENTITY_OPEN):
                cands = [n + ENTITY_CLOSE for n in names]
            elif '"name": "track"' in block and out.endswith(VALUE_OPEN) and LOCATION in block:
                cands = [n + COMMAND_CLOSE for n in names + ["inventory"]]
            else:
                continue  # a state or searched value, or a stop string inside a longer token: generation goes on
            cand_ids = [self.tok(c, add_special_tokens=False)["input_ids"] for c in cands]
            if len(gen) + max(len(c) for c in cand_ids) > self.max_new_tokens:
                break
            per_token = self.score_continuations(ids + gen, cand_ids)
            best = self._choose(per_token)
            gen, logps = gen + cand_ids[best], logps + per_token[best]
            self.grounded += 1
        return gen, logps

    def _choose(self, per_token: list[list[float]]) -> int:
        """The candidate with the highest summed log-probability (greedy), or a draw from the softmax of those sums
        over ``temperature``."""
        sums = torch.tensor([sum(t) for t in per_token])
        if self.temperature > 0:
            return int(torch.multinomial(torch.softmax(sums / self.temperature, dim=0), 1))
        return int(sums.argmax())

    def _append_act(self, ids: list[int], gen: list[int], logps: list[float], calls: list[tuple[str, dict]],
                    admissible: list[str]) -> Decision:
        """``act_each_turn``: the generated turn ``gen`` kept up to its last complete ``</tool_call>``, then
        an ``act`` call opened as the chat template separates parallel calls (``"\n"`` + ``ACT_PREFIX``), its
        command scored over ``admissible``. The generated tokens kept are recorded as sampled, the opening as
        forced (``env_mask`` 0). Returns the act with ``calls`` (every complete call) ahead of it in ``before``."""
        keep = len(gen) - gen[::-1].index(self.close_id)  # after the last "</tool_call>" (one added token)
        opening = self.next_act_ids
        head = gen[:keep] + opening
        dec = self._score_act(ids, head, logps[:keep] + [0.0] * len(opening), [1] * keep + [0] * len(opening),
                              admissible, self.tok.decode(gen[:keep], skip_special_tokens=False) + "\n" + ACT_PREFIX)
        dec.before = calls
        dec.appended = True
        self.appended += 1
        return dec

    def _record(self, prompt_ids: list[int], completion_ids: list[int], logprobs: list[float],
                mask: list[int]) -> None:
        """Keep the turn for GRPO (``turns``): a turn that did not end with ``<|im_end|>`` is closed with it. The
        entry's ``anchor`` is the latest environment observation the turn's prompt showed (GiGPO's anchor state,
        ``evoharness.training.advantages``)."""
        anchor = self._anchor
        if completion_ids and completion_ids[-1] == self.end_id:
            self.turns.append({"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs,
                               "env_mask": mask, "anchor": anchor})
        else:
            self.turns.append({"prompt_ids": prompt_ids, "completion_ids": completion_ids + [self.end_id],
                               "logprobs": logprobs + [0.0], "env_mask": mask + [0], "anchor": anchor})

    def _score_act(self, ids: list[int], head: list[int], head_logps: list[float], head_mask: list[int],
                   admissible: list[str], generated: str = "", record: bool = True) -> Decision:
        """Choose the command of an ``act`` call whose text so far is ``ids + head`` (``head`` ends where the command
        string opens): greedy, the admissible command with the highest summed log-probability; sampled
        (``temperature`` > 0), a draw from the softmax of those sums divided by the temperature, so a rollout's
        command is always admissible. Each candidate is scored with the call's closing ``"}}\n</tool_call>``, so
        that a prefix ("cabinet 1") does not win over the full name ("cabinet 10"), and the closing tokens are the
        ones training saw."""
        cands = [self.tok(c + COMMAND_CLOSE, add_special_tokens=False)["input_ids"] for c in admissible]
        per_token = self.score_continuations(ids + head, cands)
        best = self._choose(per_token)
        self.generated_tokens += len(cands[best])
        self.scored += 1
        if record:
            self._record(ids, head + cands[best], head_logps + per_token[best], head_mask + [1] * len(cands[best]))
        return Decision("act", {"command": admissible[best]}, text=generated + admissible[best] + COMMAND_CLOSE)

    @torch.no_grad()
    def score_continuations(self, context: list[int], cands: list[list[int]]) -> list[list[float]]:
        """Per-token log-probabilities (nats) of each token list in ``cands`` (each non-empty) after ``context``.

        The context is encoded once; its KV cache (transformers ``DynamicCache``) is repeated over ``chunk``
        candidates per forward pass, so a decision costs one context pass plus candidates x candidate length
        tokens (measured on a 3.7M-parameter model, ~600-token prompts: 0.065 s per decision against 0.41 s when the
        context was re-encoded with every chunk)."""
        import copy

        if self.engine is not None:
            return self.engine.score(context, cands)
        device = self.model.device
        out = self.model(input_ids=torch.tensor([context], device=device), use_cache=True, logits_to_keep=1)
        first = torch.log_softmax(out.logits[0, -1].float(), dim=-1)  # predicts every candidate's first token
        result: list[list[float]] = []
        for start in range(0, len(cands), self.chunk):
            part = cands[start:start + self.chunk]
            longest = max(len(c) for c in part)
            batch = torch.full((len(part), longest), self.tok.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(part), len(context) + longest), dtype=torch.long)
            for i, c in enumerate(part):
                batch[i, :len(c)] = torch.tensor(c)
                mask[i, :len(context) + len(c)] = 1  # right padding: real tokens never attend to it
            cache = copy.deepcopy(out.cache)
            cache.batch_repeat_interleave(len(part))
            logits = self.model(input_ids=batch.to(device), attention_mask=mask.to(device),
                                cache=cache, use_cache=True).logits
            logp = torch.log_softmax(logits.float(), dim=-1)  # position j predicts candidate token j + 1
            for i, c in enumerate(part):
                tail = logp[i, torch.arange(len(c) - 1), torch.tensor(c[1:])].tolist() if len(c) > 1 else []
                result.append([first[c[0]].item()] + tail)
        return result

    def observe(self, text: str) -> None:
        """Append the tool response and the next generation prompt (Qwen3 template layout)."""
        if self.context == "turn":
            return
        suffix = f"\n<|im_start|>user\n<tool_response>\n{text}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        self._append_env(self.tok(suffix, add_special_tokens=False)["input_ids"])

    def _append_env(self, ids: list[int]) -> None:
        self.completion_ids += ids
        self.env_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def rollout(self) -> dict:
        """The episode as TRL's ``rollout_func`` expects one entry, trailing environment tokens removed.

        Raises NotImplementedError in the ``turn`` context, whose episode is not one token sequence."""
        if self.context == "turn":
            raise NotImplementedError("GRPO rollouts need the history context (one token sequence per episode)")
        n = len(self.env_mask)
        while n and self.env_mask[n - 1] == 0:
            n -= 1
        return {"prompt_ids": self.prompt_ids, "completion_ids": self.completion_ids[:n],
                "logprobs": self.logprobs[:n], "env_mask": self.env_mask[:n]}
