"""Batched policy inference: the episodes of one process advance together, one batched forward pass per turn.

Each episode runs in its own thread with its own ``LMPolicy`` (``engine=``), whose two model calls, generating a
turn and scoring candidate continuations (an act's admissible commands, a grounded ``track`` name), become requests
to a ``BatchEngine``. The engine runs in the thread that called ``serve``: once every live episode is waiting on
it (or ``max_wait_s`` after the first request, so that a slow environment step does not stall the others) it takes
all pending requests and answers them in batches:

* generation: left-padded prompts through ``model.generate`` (one batched prefill, then the batch decodes
  together with its KV cache), grouped by temperature; each row stops where batch-1 generation would have
  (``<|im_end|>``, its own stop strings by transformers' ``StopStringCriteria``, or its own token budget), and
  returns its tokens with their log-probabilities;
* scoring: the contexts prefilled in one left-padded pass, then every (context, candidate) row scored against a
  copy of its context's KV cache, ``chunk_rows`` rows per forward pass.

Greedy choices equal batch-1 ones up to float reduction order (a padded batch sums in another order); where two
candidates tie to within that, the choice can differ (counted by ``scripts/bench_inference.py``).
"""

from __future__ import annotations

import copy
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
from transformers import StoppingCriteria


@dataclass
class _Request:
    kind: str  # "generate" | "score"
    args: tuple
    done: threading.Event = field(default_factory=threading.Event)
    result: object = None
    error: BaseException | None = None


class BatchEngine:
    """Answers ``generate`` and ``score`` requests from episode threads in batches (module docstring).

    Args:
        model, tokenizer: from ``evoharness.model.load_policy``; the tokenizer's pad token pads the batches.
        max_batch: generation requests per ``model.generate`` call.
        max_wait_s: how long the first pending request waits for the other live episodes before its batch runs.
        chunk_rows: (context, candidate) rows per scoring forward pass.

    ``stats`` counts batches, requests and rows, for the benchmark.
    """

    def __init__(self, model, tokenizer, max_batch: int = 16, max_wait_s: float = 1.0, chunk_rows: int = 64):
        self.model, self.tok = model, tokenizer
        self.max_batch, self.max_wait_s, self.chunk_rows = max_batch, max_wait_s, chunk_rows
        self.end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.end_id
        self._cv = threading.Condition()
        self._pending: list[_Request] = []
        self._live = 0
        self._stops: dict[tuple[str, ...], object] = {}
        self._failed: BaseException | None = None
        self._prefixes: dict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.stats: Counter = Counter()

    # -- the episode threads' side ---------------------------------------------------------------------------------

    def open(self, clients: int) -> None:
        """Announce ``clients`` episode threads (call before starting them); each calls ``close`` when it ends."""
        with self._cv:
            self._live += clients

    def close(self) -> None:
        """One episode thread has ended: the engine no longer waits for its requests."""
        with self._cv:
            self._live -= 1
            self._cv.notify_all()

    def generate(self, ids: list[int], stop_strings: list[str] | None, max_new_tokens: int,
                 temperature: float) -> tuple[list[int], list[float]]:
        """One turn after ``ids``, as ``LMPolicy._generate`` returns it: (generated ids, their log-probabilities),
        cut after ``<|im_end|>``, the first stop string or ``max_new_tokens``. Blocks until its batch has run."""
        return self._submit("generate", (list(ids), tuple(stop_strings or ()), int(max_new_tokens),
                                         float(temperature)))

    def score(self, context: list[int], cands: list[list[int]]) -> list[list[float]]:
        """Per-token log-probabilities (nats) of each token list of ``cands`` after ``context``, as
        ``LMPolicy.score_continuations`` returns them. Blocks until its batch has run."""
        return self._submit("score", (list(context), [list(c) for c in cands]))

    def _submit(self, kind: str, args: tuple):
        req = _Request(kind, args)
        with self._cv:
            if self._failed is not None:
                raise RuntimeError("the batch engine stopped serving") from self._failed
            self._pending.append(req)
            self._cv.notify_all()
        req.done.wait()
        if req.error is not None:
            raise req.error
        return req.result

    # -- the serving thread's side ---------------------------------------------------------------------------------

    def serve(self) -> None:
        """Answer requests in batches until every announced episode thread has closed. Should serving itself fail,
        every waiting and later request raises (so no episode thread waits forever) and the error is re-raised."""
        try:
            self._serve()
        except BaseException as exc:
            with self._cv:
                self._failed = exc
                waiting, self._pending = self._pending, []
            for req in waiting:
                req.error = RuntimeError("the batch engine stopped serving")
                req.done.set()
            raise

    def _serve(self) -> None:
        while True:
            with self._cv:
                first = None
                while True:
                    if self._pending and len(self._pending) >= self._live:
                        break
                    if not self._pending:
                        if self._live <= 0:
                            return
                        self._cv.wait(0.5)
                        continue
                    first = first or time.monotonic()
                    left = first + self.max_wait_s - time.monotonic()
                    if left <= 0:
                        break
                    self._cv.wait(left)
                batch, self._pending = self._pending, []
            self._run(batch)

    def _run(self, batch: list[_Request]) -> None:
        groups: dict[tuple, list[_Request]] = {}
        for req in batch:
            key = ("score",) if req.kind == "score" else ("generate", req.args[3])  # stop strings differ per row
            groups.setdefault(key, []).append(req)
        for key, reqs in groups.items():
            for start in range(0, len(reqs), self.max_batch):
                part = reqs[start:start + self.max_batch]
                t0 = time.perf_counter()
                try:
                    with torch.no_grad():
                        results = self._score(part) if key[0] == "score" else self._generate(part, key[1])
                except BaseException as exc:  # noqa: BLE001 - handed to every waiting episode
                    for req in part:
                        req.error = exc
                        req.done.set()
                    continue
                self.stats[f"{key[0]}_s"] += time.perf_counter() - t0
                for req, res in zip(part, results):
                    req.result = res
                    req.done.set()

    def _left_padded(self, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        longest = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), longest), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, longest - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, longest - len(s):] = 1
        return ids, mask

    def _stop_criteria(self, stops: tuple[str, ...]):
        if stops not in self._stops:
            from transformers import StopStringCriteria

            # built once per set: its vocabulary tables cost more than a short turn's forward passes
            self._stops[stops] = StopStringCriteria(self.tok, list(stops))
        return self._stops[stops]

    def _generate(self, reqs: list[_Request], temperature: float) -> list[tuple]:
        from transformers import StoppingCriteriaList

        ids, mask = self._left_padded([r.args[0] for r in reqs])
        rows = _RowStops({s: self._stop_criteria(s) for s in {r.args[1] for r in reqs} if s},
                         [r.args[1] for r in reqs], [r.args[2] for r in reqs], ids.shape[1], self.end_id)
        sample = temperature > 0
        out = self.model.generate(
            input_ids=ids.to(self.model.device), attention_mask=mask.to(self.model.device),
            max_new_tokens=max(r.args[2] for r in reqs), do_sample=sample, temperature=temperature if sample else None,
            top_k=0 if sample else None, top_p=1.0 if sample else None, eos_token_id=self.end_id,
            pad_token_id=self.pad_id, stopping_criteria=StoppingCriteriaList([rows]), output_scores=True,
            return_dict_in_generate=True)
        logps = self.model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
        new = out.sequences[:, ids.shape[1]:]
        length = [n if n is not None else min(r.args[2], new.shape[1]) for n, r in zip(rows.length, reqs)]
        self._keep_prefixes(reqs, out.cache, new, length, ids.shape[1])
        self.stats["generate_batches"] += 1
        self.stats["generate_requests"] += len(reqs)
        self.stats["generated_tokens"] += sum(length)
        self.stats["generate_steps"] += new.shape[1]
        return [(new[i, :length[i]].tolist(), logps[i, :length[i]].tolist()) for i in range(len(reqs))]

    def _keep_prefixes(self, reqs: list[_Request], cache, new: torch.Tensor, length: list[int],
                       prompt_len: int) -> None:
        """Keep each row's KV cache of its prompt and generated tokens but the last (what ``generate`` fed through the
        model), unpadded, keyed by the whole sequence: the score request that usually follows (an act's command after
        a generated turn, a grounded name) then feeds only the last token and the candidates."""
        for i, r in enumerate(reqs):
            if length[i] < 1:
                continue
            pad = prompt_len - len(r.args[0])
            end = prompt_len + length[i] - 1
            layers = [(layer.keys[i:i + 1, :, pad:end].clone(), layer.values[i:i + 1, :, pad:end].clone())
                      for layer in cache.layers]
            self._prefixes[tuple(r.args[0]) + tuple(new[i, :length[i]].tolist())] = layers
        while len(self._prefixes) > 2 * self.max_batch:  # oldest first: a prefix not scored soon never will be
            self._prefixes.pop(next(iter(self._prefixes)))

    def _score(self, reqs: list[_Request]) -> list[list[list[float]]]:
        """Score requests: those whose context a generation just produced continue from its kept KV cache, the
        others are prefilled; each request's per-candidate per-token log-probabilities, in order."""
        kept = [self._prefixes.pop(tuple(r.args[0]), None) for r in reqs]
        hits = [i for i, k in enumerate(kept) if k is not None]
        misses = [i for i, k in enumerate(kept) if k is None]
        results: list = [None] * len(reqs)
        if misses:
            for i, res in zip(misses, self._score_prefilled([reqs[i] for i in misses])):
                results[i] = res
        for i in hits:  # one context at a time: padding contexts to the longest would copy more cache than it saves
            results[i] = self._score_cached([reqs[i]], [kept[i]])[0]
        self.stats["score_batches"] += 1
        self.stats["score_requests"] += len(reqs)
        self.stats["score_prefix_hits"] += len(hits)
        return results

    def _score_cached(self, reqs: list[_Request], kept: list[list[tuple]]) -> list[list[list[float]]]:
        """Score against kept caches: each row feeds its context's last token, then the candidate; position j of the
        row predicts candidate token j."""
        from transformers import DynamicCache

        device = self.model.device
        lengths = [len(r.args[0]) - 1 for r in reqs]  # cached tokens of each context
        longest = max(lengths)
        ctx_mask = torch.zeros((len(reqs), longest), dtype=torch.long)
        layers = []
        for layer in range(len(kept[0])):
            ks, vs = [], []
            for i, rows in enumerate(kept):
                k, v = rows[layer]
                gap = longest - lengths[i]  # left padding: zeros that the mask hides
                ks.append(torch.nn.functional.pad(k, (0, 0, gap, 0)))
                vs.append(torch.nn.functional.pad(v, (0, 0, gap, 0)))
            layers.append((torch.cat(ks).to(device), torch.cat(vs).to(device)))
        for i, n in enumerate(lengths):
            ctx_mask[i, longest - n:] = 1
        rows = [(i, c) for i, r in enumerate(reqs) for c in r.args[1]]
        per_row: list[list[float]] = []
        for start in range(0, len(rows), self.chunk_rows):
            part = rows[start:start + self.chunk_rows]
            width = 1 + max(len(c) for _, c in part)
            owner = torch.tensor([i for i, _ in part], dtype=torch.long)
            batch = torch.full((len(part), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(part), width), dtype=torch.long)
            for j, (i, c) in enumerate(part):
                batch[j, :1 + len(c)] = torch.tensor([reqs[i].args[0][-1], *c], dtype=torch.long)
                mask[j, :1 + len(c)] = 1
            pos = torch.tensor([lengths[i] for i, _ in part])[:, None] + torch.arange(width)[None, :]
            cache = DynamicCache(ddp_cache_data=[(k[owner.to(device)], v[owner.to(device)]) for k, v in layers])
            full_mask = torch.cat([ctx_mask[owner], mask], dim=1)
            logits = self.model(input_ids=batch.to(device), attention_mask=full_mask.to(device),
                                position_ids=pos.to(device), cache=cache, use_cache=True).logits
            logp = torch.log_softmax(logits.float(), dim=-1)
            for j, (_, c) in enumerate(part):
                per_row.append(logp[j, torch.arange(len(c)), torch.tensor(c)].tolist())
            self.stats["score_rows"] += len(part)
        out, k = [], 0
        for r in reqs:
            out.append(per_row[k:k + len(r.args[1])])
            k += len(r.args[1])
        return out

    def _score_prefilled(self, reqs: list[_Request]) -> list[list[list[float]]]:
        device = self.model.device
        contexts = [r.args[0] for r in reqs]
        ids, mask = self._left_padded(contexts)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids.to(device), attention_mask=mask.to(device),
                         position_ids=positions.to(device), use_cache=True, logits_to_keep=1)
        first = torch.log_softmax(out.logits[:, -1].float(), dim=-1)  # predicts each candidate's first token
        rows = [(i, c) for i, r in enumerate(reqs) for c in r.args[1]]
        per_row: list[list[float]] = []
        for start in range(0, len(rows), self.chunk_rows):
            part = rows[start:start + self.chunk_rows]
            longest = max(len(c) for _, c in part)
            owner = torch.tensor([i for i, _ in part], dtype=torch.long)
            batch = torch.full((len(part), longest), self.pad_id, dtype=torch.long)
            cand_mask = torch.zeros((len(part), longest), dtype=torch.long)
            for j, (_, c) in enumerate(part):
                batch[j, :len(c)] = torch.tensor(c, dtype=torch.long)
                cand_mask[j, :len(c)] = 1  # right padding: real tokens never attend to it
            lengths = torch.tensor([len(contexts[i]) for i, _ in part], dtype=torch.long)
            pos = lengths[:, None] + torch.arange(longest)[None, :]
            cache = copy.deepcopy(out.cache)
            cache.batch_select_indices(owner.to(device))
            logits = self.model(input_ids=batch.to(device),
                                attention_mask=torch.cat([mask[owner], cand_mask], dim=1).to(device),
                                position_ids=pos.to(device), cache=cache, use_cache=True).logits
            logp = torch.log_softmax(logits.float(), dim=-1)  # position j predicts candidate token j + 1
            for j, (i, c) in enumerate(part):
                tail = logp[j, torch.arange(len(c) - 1), torch.tensor(c[1:])].tolist() if len(c) > 1 else []
                per_row.append([first[i, c[0]].item()] + tail)
            self.stats["score_rows"] += len(part)
        results, k = [], 0
        for r in reqs:
            results.append(per_row[k:k + len(r.args[1])])
            k += len(r.args[1])
        return results


class _RowStops(StoppingCriteria):
    """A transformers stopping criterion with each row's own stop: row i of a batched ``generate`` is done after
    ``<|im_end|>``, once ``StopStringCriteria`` of its stop strings ``sets[i]`` fires, or at ``budgets[i]`` new
    tokens, as batch-1 generation of that row alone would stop. ``length[i]``: its generated tokens (None while
    open)."""

    def __init__(self, criteria: dict, sets: list[tuple[str, ...]], budgets: list[int], prompt_len: int,
                 end_id: int):
        super().__init__()
        self.criteria, self.sets, self.budgets = criteria, sets, budgets
        self.prompt_len, self.end_id = prompt_len, end_id
        self.length: list[int | None] = [None] * len(sets)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        k = input_ids.shape[1] - self.prompt_len
        fired = {s: crit(input_ids, scores) for s, crit in self.criteria.items()}
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        last = input_ids[:, -1].tolist()
        for i, stops in enumerate(self.sets):
            if self.length[i] is None and (last[i] == self.end_id or k >= self.budgets[i]
                                           or (stops and bool(fired[stops][i]))):
                self.length[i] = k
            done[i] = self.length[i] is not None
        return done
