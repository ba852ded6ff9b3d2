"""Policy inference shared by the episodes of one process: one model, its KV caches reused across their calls.

Each episode runs in its own thread with its own ``LMPolicy`` (``engine=``), whose two model calls, generating a
turn and scoring candidate continuations (an act's admissible commands, a grounded ``track`` name), become requests
to a ``BatchEngine`` served by the thread that called ``serve``. While one episode's call runs, the others step their
environments (in their own processes) and build their prompts. The engine:

* keeps the KV cache of every sequence it generated (the last few per episode) and starts each call from the
  longest prefix a kept sequence shares: the score that follows a generated turn feeds only the turn's last token,
  the generation that follows a grounded name only the name, and a new turn only what differs from the last one;
* scores all candidates of a context in one row under a tree-shaped attention mask (each candidate token sees the
  context, the context's last token and its own candidate's earlier tokens), so the context's cache is read once
  instead of copied per candidate;
* generates one request at a time by default (each row stopping at ``<|im_end|>``, its stop strings through
  transformers' ``StopStringCriteria``, or its budget), or with ``batch_generation`` all pending requests in one
  left-padded ``model.generate`` call, once every live episode waits or ``max_wait_s`` after the first request.
  On 2 CPU cores a turn's time is its prompt's prefill, already a matrix product at batch 1, and padding prompts to
  the longest cost more than batching saved (``docs/benchmarks/inference.md``), hence the default.

Greedy choices equal batch-1 ones up to float reduction order: a reused cache and a fresh prefill sum in another
order, and where two candidates tie to within that, the choice can differ (``scripts/bench_inference.py`` counts
the episodes that differ).
"""

from __future__ import annotations

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
        model, tokenizer: from ``evoharness.training.model.load_policy``; the tokenizer's pad token pads the batches.
        max_batch: requests taken per pass, and twice the number of KV prefixes kept.
        batch_generation: generate several requests in one left-padded ``model.generate`` call (off: one call per
            request, continuing from its longest kept KV prefix; see ``_generate``).
        max_wait_s: with ``batch_generation``, how long the first pending request waits for the other live episodes
            before its batch runs (without it, requests run as they come).

    ``stats`` counts batches, requests and rows, for the benchmark.
    """

    def __init__(self, model, tokenizer, max_batch: int = 16, max_wait_s: float = 1.0, batch_generation: bool = False):
        self.model, self.tok = model, tokenizer
        self.max_batch, self.max_wait_s, self.batch_generation = max_batch, max_wait_s, batch_generation
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
                    # requests run one at a time unless generation is batched: then waiting buys nothing
                    left = first + (self.max_wait_s if self.batch_generation else 0.0) - time.monotonic()
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
        """Generation requests: in one left-padded ``generate`` call when ``batch_generation`` is on, else one call
        per request continuing from the longest kept KV prefix (the default: on CPUs the prompt's prefill is most
        of a turn, and padding a batch to its longest prompt costs more than batching saves)."""
        if self.batch_generation and len(reqs) > 1:
            return self._generate_padded(reqs, temperature)
        return [self._generate_one(r, temperature) for r in reqs]

    def _sampling(self, temperature: float) -> dict:
        sample = temperature > 0
        return {"do_sample": sample, "temperature": temperature if sample else None, "top_k": 0 if sample else None,
                "top_p": 1.0 if sample else None, "eos_token_id": self.end_id, "pad_token_id": self.pad_id,
                "output_scores": True, "return_dict_in_generate": True}

    def _generate_one(self, req: _Request, temperature: float) -> tuple:
        from transformers import StoppingCriteriaList

        ids, stops, budget = req.args[0], req.args[1], req.args[2]
        device = self.model.device
        cache, reused = self._prefix_cache(ids)
        rows = _RowStops({stops: self._stop_criteria(stops)} if stops else {}, [stops], [budget], len(ids),
                         self.end_id)
        inputs = torch.tensor([ids], device=device)
        out = self.model.generate(input_ids=inputs, attention_mask=torch.ones_like(inputs), cache=cache,
                                  max_new_tokens=budget, stopping_criteria=StoppingCriteriaList([rows]),
                                  **self._sampling(temperature))
        logps = self.model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
        new = out.sequences[:, len(ids):]
        length = [rows.length[0] if rows.length[0] is not None else min(budget, new.shape[1])]
        self._keep_prefixes([req], out.cache, new, length, len(ids))
        self.stats["generate_batches"] += 1
        self.stats["generate_requests"] += 1
        self.stats["generated_tokens"] += length[0]
        self.stats["generate_steps"] += new.shape[1]
        self.stats["prefix_tokens_reused"] += reused
        self.stats["prompt_tokens"] += len(ids)
        return new[0, :length[0]].tolist(), logps[0, :length[0]].tolist()

    def _prefix_cache(self, tokens: list[int]):
        """A ``DynamicCache`` of the longest prefix of ``tokens`` (all but its last token at most) that a kept
        sequence shares, and its length; (None, 0) when none shares a token. The kept tensors are not changed: a
        forward pass appends by concatenation into new ones."""
        from transformers import DynamicCache

        best, best_len = None, 0
        if len(tokens) > 1:
            want = torch.tensor(tokens[:-1])
            for key, layers in self._prefixes.items():
                m = min(len(key) - 1, len(want))  # a kept entry caches its sequence but the last token
                if m <= best_len:
                    continue
                diff = (torch.tensor(key[:m]) != want[:m]).nonzero()
                n = int(diff[0]) if len(diff) else m
                if n > best_len:
                    best, best_len = layers, n
        if best is None:
            return None, 0
        device = self.model.device
        return DynamicCache(ddp_cache_data=[(k[:, :, :best_len].to(device), v[:, :, :best_len].to(device))
                                            for k, v in best]), best_len

    def _generate_padded(self, reqs: list[_Request], temperature: float) -> list[tuple]:
        from transformers import StoppingCriteriaList

        ids, mask = self._left_padded([r.args[0] for r in reqs])
        rows = _RowStops({s: self._stop_criteria(s) for s in {r.args[1] for r in reqs} if s},
                         [r.args[1] for r in reqs], [r.args[2] for r in reqs], ids.shape[1], self.end_id)
        out = self.model.generate(
            input_ids=ids.to(self.model.device), attention_mask=mask.to(self.model.device),
            max_new_tokens=max(r.args[2] for r in reqs), stopping_criteria=StoppingCriteriaList([rows]),
            **self._sampling(temperature))
        logps = self.model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
        new = out.sequences[:, ids.shape[1]:]
        length = [n if n is not None else min(r.args[2], new.shape[1]) for n, r in zip(rows.length, reqs)]
        self._keep_prefixes(reqs, out.cache, new, length, ids.shape[1])
        self.stats["generate_batches"] += 1
        self.stats["generate_requests"] += len(reqs)
        self.stats["generated_tokens"] += sum(length)
        self.stats["generate_steps"] += new.shape[1]
        self.stats["prompt_tokens"] += sum(len(r.args[0]) for r in reqs)
        return [(new[i, :length[i]].tolist(), logps[i, :length[i]].tolist()) for i in range(len(reqs))]

    def _keep_prefixes(self, reqs: list[_Request], cache, new: torch.Tensor, length: list[int],
                       prompt_len: int) -> None:
        """Keep each row's KV cache of its prompt and generated tokens but the last (what ``generate`` fed through the
        model), unpadded, keyed by the whole sequence: the score request that usually follows (an act's command after
        a generated turn, a grounded name) feeds only the last token and the candidates, and the lane's next
        generation (after a grounded name, or the next turn's prompt) starts from the longest prefix it shares."""
        for i, r in enumerate(reqs):
            if length[i] < 1:
                continue
            pad = prompt_len - len(r.args[0])
            end = prompt_len + length[i] - 1
            layers = [(layer.keys[i:i + 1, :, pad:end].clone(), layer.values[i:i + 1, :, pad:end].clone())
                      for layer in cache.layers]
            self._prefixes.pop(key := tuple(r.args[0]) + tuple(new[i, :length[i]].tolist()), None)
            self._prefixes[key] = layers  # most recent last
        while len(self._prefixes) > 2 * self.max_batch:  # oldest first: a lane's next turn starts from its newest
            self._prefixes.pop(next(iter(self._prefixes)))

    def _score(self, reqs: list[_Request]) -> list[list[list[float]]]:
        """Score requests one context at a time (``_score_one``); a context that a generation just produced continues
        from the KV cache it left. Returns each request's per-candidate per-token log-probabilities, in order."""
        results = []
        for r in reqs:
            cache, reused = self._prefix_cache(r.args[0])
            self.stats["score_prefix_hits"] += reused == len(r.args[0]) - 1
            self.stats["prefix_tokens_reused"] += reused
            self.stats["prompt_tokens"] += len(r.args[0])
            results.append(self._score_one(r.args[0], r.args[1], cache, reused))
        self.stats["score_batches"] += 1
        self.stats["score_requests"] += len(reqs)
        return results

    def _score_one(self, context: list[int], cands: list[list[int]], cache, reused: int) -> list[list[float]]:
        """Every candidate of one context in a single row: the KV cache of all but the context's last token
        (``cache`` holding its first ``reused`` tokens, the rest prefilled on top) read once, then its last token and
        each candidate's tokens but the last, under a tree-shaped attention mask (each candidate token sees the context,
        the last token and its own candidate's earlier
        tokens) with each candidate's positions starting after the context. The last token's logits predict every
        candidate's first token; candidate token j's, its token j + 1. Costs one pass over the candidates' tokens
        instead of one copy of the context's cache per candidate."""
        from transformers import DynamicCache

        device = self.model.device
        n = len(context) - 1  # cached positions
        cache = cache if cache is not None else DynamicCache()
        if reused < n:  # prefill what the kept prefix does not cover
            cache = self.model(input_ids=torch.tensor([context[reused:n]], device=device), cache=cache,
                               position_ids=torch.arange(reused, n, device=device)[None], use_cache=True,
                               logits_to_keep=1).cache
        tokens, positions, starts = [context[-1]], [n], []
        for c in cands:
            starts.append(len(tokens))
            tokens += c[:-1]  # a candidate's last token predicts nothing that is scored
            positions += range(n + 1, n + len(c))
        q = len(tokens)
        mask = torch.zeros((q, n + q), dtype=torch.bool)
        mask[:, :n + 1] = True  # the context and its last token
        for s, c in zip(starts, cands):
            for j in range(len(c) - 1):
                mask[s + j, n + s:n + s + j + 1] = True
        logits = self.model(input_ids=torch.tensor([tokens], device=device), attention_mask=mask[None, None].to(device),
                            position_ids=torch.tensor([positions], device=device), cache=cache,
                            use_cache=True).logits[0]
        logp = torch.log_softmax(logits.float(), dim=-1)
        self.stats["score_rows"] += len(cands)
        out = []
        for s, c in zip(starts, cands):
            rows = torch.tensor([0] + list(range(s, s + len(c) - 1)))
            out.append(logp[rows, torch.tensor(c)].tolist())
        return out

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
