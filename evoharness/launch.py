"""Run a training entry point under ``accelerate launch`` in a child process (as TRL's docs launch trainers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ACCELERATE_DIR = Path(__file__).resolve().parent.parent / "accelerate"


def accelerate_config(num_processes: int) -> Path:
    """The repo's Accelerate config for 1 or 2 CPU processes (``accelerate/cpu_{n}proc.yaml``)."""
    path = ACCELERATE_DIR / f"cpu_{num_processes}proc.yaml"
    if not path.exists():
        raise FileNotFoundError(f"no Accelerate config for {num_processes} CPU processes: {path}")
    return path


def accelerate_launch(module: str, spec: dict, workdir: str | Path, num_processes: int = 1,
                      env: dict | None = None, config_file: str | Path | None = None) -> dict:
    """Write ``spec`` to ``workdir/spec.json``, run ``accelerate launch -m module --spec ...``, return its
    ``workdir/result.json``. Output streams to this process's stdout (progress bars included).

    ``config_file``: an Accelerate config (relative paths from the repo root, e.g. ``accelerate/fsdp_gpu.yaml``);
    default: the repo's CPU config for ``num_processes``.

    Raises RuntimeError with the exit code and the command when the child fails.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "spec.json").write_text(json.dumps(spec, indent=1))
    if config_file:
        config = Path(config_file) if Path(config_file).is_absolute() else ACCELERATE_DIR.parent / config_file
        if not config.exists():
            raise FileNotFoundError(f"Accelerate config {config} not found (sft.accelerate_config or "
                                    "grpo.accelerate_config)")
    else:
        config = accelerate_config(num_processes)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
           "--num_processes", str(num_processes),  # the stage config's count wins over the file's
           "-m", module, "--spec", str(workdir / "spec.json")]
    child_env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                 "PYTHONPATH": os.pathsep.join([str(ACCELERATE_DIR.parent), os.environ.get("PYTHONPATH", "")]),
                 **(env or {})}
    proc = subprocess.run(cmd, env=child_env)
    if proc.returncode != 0:
        raise RuntimeError(f"{module} failed with exit code {proc.returncode}: {' '.join(cmd)}; its checkpoints in "
                           f"{workdir} let a re-run resume")
    return json.loads((workdir / "result.json").read_text())
