"""One turn's two model calls for 8 episodes, one at a time against batched
(``evoharness.policy.batching.BatchEngine``).

    python scripts/bench_engine_calls.py models/evoharness-full-sft [--threads 1]

Eight prompts of 530 to 1,346 tokens (the range of ``turn``-context prompts late in an episode), each generating a
turn up to an act's command (greedy, score decoding's stop strings) and then scoring 35 admissible commands after
it: (b) ``LMPolicy._generate`` and ``score_continuations`` per prompt; (c) the same calls from 8 threads through one
``BatchEngine``. Prints the seconds of each part and the engine's counters, all from one run.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as `python scripts/bench_engine_calls.py`


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("policy", help="a model or release folder")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    a = p.parse_args(argv)
    import torch

    from evoharness.policy.batching import BatchEngine
    from evoharness.policy.lm_policy import COMMAND_OPEN, ENTITY_OPEN, VALUE_OPEN, LMPolicy
    from evoharness.training.model import load_policy

    torch.set_num_threads(a.threads)
    model, tok = load_policy(a.policy)
    model.eval()
    prompts = []
    for i in range(8):
        obs = (f"You arrive at cabinet {i}. On the cabinet {i}, you see a mug 2, a pencil 3, a cd 1. ") * (12 + 3 * i)
        msgs = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": obs}]
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])
    cands = [tok(f"go to cabinet {k}" + '"}}\n</tool_call>', add_special_tokens=False)["input_ids"] for k in range(35)]
    stops = [COMMAND_OPEN, ENTITY_OPEN, VALUE_OPEN]
    alone = LMPolicy(model, tok, 256, context="turn", decoding="score")
    t0 = time.perf_counter()
    gens = [alone._generate(x, stops)[0] for x in prompts]
    t_gen = time.perf_counter() - t0
    t0 = time.perf_counter()
    for x, g in zip(prompts, gens):
        alone.score_continuations(x + g, cands)
    t_score = time.perf_counter() - t0
    engine = BatchEngine(model, tok)

    def turn(i):
        try:
            g, _ = engine.generate(prompts[i], stops, 256, 0.0)
            engine.score(prompts[i] + g, cands)
        finally:
            engine.close()

    engine.open(8)
    threads = [threading.Thread(target=turn, args=(i,)) for i in range(8)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    engine.serve()
    for t in threads:
        t.join()
    t_batched = time.perf_counter() - t0
    print(f"prompt lengths {[len(x) for x in prompts]}, {a.threads} torch thread(s)")
    print(f"(b) one at a time: generate {t_gen:.2f} s, score {t_score:.2f} s, total {t_gen + t_score:.2f} s")
    print(f"(c) batched: generate {engine.stats['generate_s']:.2f} s, score {engine.stats['score_s']:.2f} s, "
          f"total {t_batched:.2f} s; {dict(engine.stats)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
