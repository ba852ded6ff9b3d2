"""Stop the flow runs in flight on the deployments' work pool before their server and worker stop: cancel them
through Prefect (state Cancelled) and close the MLflow runs they left RUNNING as KILLED, with the reason; or, with
``--drain``, wait for them to finish.

    python scripts/stop_flow_runs.py [--drain] [--timeout S] [--pool evoharness-process] [--repo PATH]

``scripts/deploy.sh stop`` (``make deploy-stop``; ``DRAIN=1 make deploy-stop`` drains) runs it with the server's
``PREFECT_API_URL`` while the worker is still up: the process worker sees the run go Cancelling, kills its process
(and with it any trainer it launched: ``evoharness.training.launch``) and marks it Cancelled. A run still not final
after ``--timeout`` seconds is set Cancelled by force. Each run's MLflow store is its ``repo`` parameter's, else
``--repo``. Prints one line per run: its name, id and final state, and the MLflow runs closed.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterState,
    FlowRunFilterStateType,
    WorkPoolFilter,
    WorkPoolFilterName,
)
from prefect.client.schemas.objects import StateType
from prefect.states import Cancelled, Cancelling

from evoharness.faults import close_flow_run_runs
from evoharness.registry.tracking import configure

IN_FLIGHT = [StateType.PENDING, StateType.RUNNING, StateType.CANCELLING, StateType.PAUSED]


def in_flight(client, pool: str) -> list:
    """The flow runs of ``pool`` that are pending, running, pausing or being cancelled."""
    return client.read_flow_runs(
        flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=IN_FLIGHT))),
        work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])))


def wait_final(client, ids: list, timeout: float, what: str) -> dict:
    """Poll the runs ``ids`` until each is in a final state or ``timeout`` s pass; returns id -> last state. Prints
    a line every 30 s with how many are left."""
    start, last_line, states = time.time(), 0.0, {}
    while True:
        states = {i: client.read_flow_run(i).state for i in ids}
        left = [i for i, s in states.items() if not (s and s.is_final())]
        if not left or time.time() - start > timeout:
            return states
        if time.time() - last_line > 30:
            print(f"{what}: {len(left)} of {len(ids)} flow runs still in flight after {time.time() - start:.0f} s "
                  f"(timeout {timeout:.0f} s)", flush=True)
            last_line = time.time()
        time.sleep(2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--drain", action="store_true", help="wait for in-flight runs to finish instead of cancelling")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds to wait (default: 120 when cancelling, 6 hours when draining)")
    p.add_argument("--pool", default="evoharness-process")
    p.add_argument("--repo", default=str(Path(__file__).resolve().parent.parent),
                   help="MLflow store of runs without a repo parameter (default: this checkout)")
    a = p.parse_args(argv)
    timeout = a.timeout if a.timeout is not None else (6 * 3600 if a.drain else 120)
    with get_client(sync_client=True) as client:
        runs = in_flight(client, a.pool)
        if not runs:
            print(f"no flow run in flight on work pool {a.pool}")
            return 0
        ids = [r.id for r in runs]
        if a.drain:
            print(f"draining {len(runs)} flow run(s) on {a.pool}: waiting up to {timeout:.0f} s", flush=True)
            states = wait_final(client, ids, timeout, "drain")
            left = [r for r in runs if not (states[r.id] and states[r.id].is_final())]
            for r in runs:
                print(f"flow run {r.name} ({r.id}): {states[r.id].name if states[r.id] else 'unknown'}")
            if not left:
                return 0
            print(f"{len(left)} flow run(s) did not finish within {timeout:.0f} s: cancelling them", flush=True)
            runs, ids = left, [r.id for r in left]
        asked_ms = int(time.time() * 1000)
        reason = f"cancelled by scripts/stop_flow_runs.py (deployments stopped) at {time.strftime('%Y-%m-%dT%H:%M:%S%z')}"
        for r in runs:
            client.set_flow_run_state(r.id, Cancelling(message=reason), force=True)
        states = wait_final(client, ids, timeout, "cancel")
        for r in runs:
            if not (states[r.id] and states[r.id].is_final()):  # the worker did not end it: mark it by force
                client.set_flow_run_state(r.id, Cancelled(message=reason + "; its process did not stop in time"),
                                          force=True)
            state = client.read_flow_run(r.id).state
            configure((r.parameters or {}).get("repo") or a.repo)
            closed = close_flow_run_runs(str(r.id), reason, since_ms=asked_ms)
            print(f"flow run {r.name} ({r.id}): {state.name if state else 'unknown'}; MLflow runs closed as KILLED: "
                  f"{', '.join(closed) or 'none'}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
