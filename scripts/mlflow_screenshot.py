"""Screenshot a registered model's GRPO run in the MLflow UI (its annealing-curve chart) with headless Chromium.

    python scripts/mlflow_screenshot.py [--repo .] [--model models:/evoharness-policy@candidate] [--out FILE.png]

Starts ``mlflow server`` on 127.0.0.1 over the embedded store, opens the GRPO run's ``annealing.png`` artifact in
the run page (success, reward, cost and meta-actions per episode by type over GRPO steps) and saves a PNG; the
page's DOM is read back to check that the run and the chart rendered.
Exits 3 (with the reason) when Chromium is not installed (Debian package ``chromium``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
                  "--virtual-time-budget=20000", "--window-size=1400,1000",
                  "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def screenshot(repo: Path, model_uri: str, out: Path) -> dict:
    """Take the screenshot; returns the run id, the URL and the PNG path. Raises RuntimeError on failure."""
    from mlflow import MlflowClient

    from evoharness.registry.promotion import parse_model_uri
    from evoharness.registry.tracking import configure

    uri = configure(repo)
    name, version = parse_model_uri(model_uri)
    mv = MlflowClient().get_model_version(name, version)
    run = MlflowClient().get_run(mv.tags["grpo_run_id"])
    port = free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", uri, "--workers", "1"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(90):
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        else:
            raise RuntimeError("mlflow server did not answer on /health within 90 s")
        url = f"{base}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}/artifacts/annealing.png"
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as profile:
            proc = subprocess.run([chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                                   f"--screenshot={out}", url], capture_output=True, text=True, timeout=180)
        if not out.exists() or out.stat().st_size == 0:
            raise RuntimeError(f"chromium wrote no screenshot (exit {proc.returncode}): {proc.stderr[-500:]}")
        with tempfile.TemporaryDirectory() as profile:
            dom = subprocess.run([chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--dump-dom", url],
                                 capture_output=True, text=True, timeout=180).stdout
        rendered = "annealing.png" in dom and run.info.run_name in dom
        return {"run_id": run.info.run_id, "url": url, "png": str(out), "rendered": rendered}
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repo", default=str(ROOT))
    p.add_argument("--model", default="models:/evoharness-policy@candidate")
    p.add_argument("--out", default=str(ROOT / "runs" / "mlflow-grpo-run.png"))
    a = p.parse_args(argv)
    if not chromium():
        print("skipped: Chromium is not installed (apt-get install chromium)", file=sys.stderr)
        return 3
    info = screenshot(Path(a.repo), a.model, Path(a.out))
    print(f"screenshot of {info['url']} -> {info['png']}; run page and chart rendered: {info['rendered']}")
    return 0 if info["rendered"] else 1


if __name__ == "__main__":
    sys.exit(main())
