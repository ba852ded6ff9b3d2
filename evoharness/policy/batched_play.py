"""Episodes played together: lanes in threads, each with its own environment process and its own copy of the
policy's episode state, sharing one model through a ``BatchEngine`` served by the calling thread.

``run_lanes`` is the runner; ``evoharness.evaluation.play.play_games`` (``evaluate.batch_episodes`` > 1) and GRPO's
``TurnRollouts`` (``grpo.batch_episodes`` > 1) give it their episodes. Each lane takes the next episode as its
current one ends, so the batch stays full until the episodes run out. What the lanes share besides the model is
the caller's: evaluation opens its Experience store once per lane (a lesson noted in one lane's episode is
recallable by every later episode of any lane, so what an episode recalls can depend on the batch, as it depends on
``workers``).
"""

from __future__ import annotations

import copy
import functools
import threading
from dataclasses import dataclass, field

from evoharness.env.pool import EnvWorker, RemoteEnv
from evoharness.policy.batching import BatchEngine


@dataclass
class Lane:
    """One lane: its index, the shared engine, ``make_env(game, max_steps, expert, data_dir)`` building the game in
    the lane's environment process, and ``state``, a dict the caller keeps per-lane objects in (made in the lane's
    thread: sqlite connections belong to the thread that opened them)."""

    index: int
    engine: BatchEngine
    make_env: object
    state: dict = field(default_factory=dict)


def lane_policy(pol, engine: BatchEngine):
    """A copy of the ``LMPolicy`` ``pol`` for one lane: the same model and settings, its own episode state and
    counters, its model calls sent to ``engine``."""
    lane = copy.copy(pol)
    lane.engine = engine
    lane.scored = lane.forced = lane.appended = lane.grounded = 0
    return lane


def run_lanes(model, tokenizer, jobs: list, lanes: int, recycle_every: int, play, finished=None) -> list:
    """Play ``jobs`` in ``lanes`` lanes; returns ``play(job, lane)``'s result for each job, in ``jobs`` order.

    ``play`` runs one episode in the lane's thread (its model calls through ``lane.engine``, its environment from
    ``lane.make_env``); ``finished(job, result)`` is called there as each ends. Environments run in ``EnvWorker``
    processes replaced every ``recycle_every`` episodes. An exception in a lane stops every lane from starting
    another episode and is raised once the episodes under way have ended (``finished`` has seen those)."""
    lanes = max(1, min(lanes, len(jobs)))
    engine = BatchEngine(model, tokenizer, max_batch=lanes)
    workers = [EnvWorker(recycle_every) for _ in range(lanes)]
    queue, lock = iter(list(enumerate(jobs))), threading.Lock()
    results: dict[int, object] = {}
    errors: list[BaseException] = []

    def run(k: int) -> None:
        lane = Lane(k, engine, functools.partial(RemoteEnv, workers[k]))
        try:
            while True:
                with lock:
                    item = None if errors else next(queue, None)
                if item is None:
                    return
                n, job = item
                results[n] = play(job, lane)
                if finished is not None:
                    finished(job, results[n])
        except BaseException as exc:  # noqa: BLE001 - raised in the calling thread below
            with lock:
                errors.append(exc)
        finally:
            engine.close()

    engine.open(lanes)
    threads = [threading.Thread(target=run, args=(k,), name=f"episode-lane-{k}", daemon=True) for k in range(lanes)]
    for t in threads:
        t.start()
    try:
        engine.serve()
    finally:
        for t in threads:
            t.join()
        for w in workers:
            w.stop()
    if errors:
        raise errors[0]
    return [results[n] for n in range(len(jobs))]
