"""Running scripts the way users do: plain python, torchrun, mpirun."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


def run_python(script: str, *args: str, env: dict[str, str] | None = None, timeout: float = 300):
    return subprocess.run([sys.executable, str(ROOT / script), *args], capture_output=True, text=True,
                          env=_env(env), timeout=timeout, cwd=ROOT)


def run_torchrun(script: str, nproc: int, *args: str, timeout: float = 600):
    from tests.harness import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), str(ROOT / script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=timeout, cwd=ROOT)


def mpirun_or_skip() -> str:
    path = shutil.which("mpirun")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("mpirun is missing on CI: .ci/run must install Debian's openmpi-bin")
        pytest.skip("mpirun not installed (apt-get install openmpi-bin)")
    return path


def run_mpirun(script: str, nproc: int, *args: str, timeout: float = 600):
    from tests.harness import free_port

    cmd = [mpirun_or_skip(), "-n", str(nproc), "--oversubscribe"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += ["-x", "PYTHONPATH", "-x", "MASTER_PORT", "-x", "OMP_NUM_THREADS",
            sys.executable, str(ROOT / script), *args]
    env = _env({"MASTER_PORT": str(free_port())})
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


def check(result: subprocess.CompletedProcess) -> str:
    # the tail of eight ranks' tracebacks shows two or three of them: every rank's own error line comes first
    errors = dict.fromkeys(line for line in result.stderr.splitlines()
                           if re.match(r"(\[rank\d+\]: )?\w*(Error|Exception)\b", line))
    assert result.returncode == 0, (
        f"exit {result.returncode}\nstdout:\n{result.stdout}\nerrors:\n" + "\n".join(errors) +
        f"\nstderr:\n{result.stderr[-6000:]}"
    )
    return result.stdout


# How the intermittent failure inside torch's C++ code (README, "Known open problem") ends a launched run: a rank
# killed by a signal. Never a transport timeout: ranks stuck in a collective are the hangs the agreement exists to
# prevent, and a rerun would hide a new one.
_INTERMITTENT = re.compile(r"exited on signal|Signal \d+ \(SIG|Segmentation fault")

# every rerun of this session (a launched script or a rank pool's body), for the summary CI prints
RERUNS: list[str] = []


def succeeds(launch: Callable[..., subprocess.CompletedProcess], script: str, *args: Any, **kwargs: Any) -> str:
    """``launch(script, *args, **kwargs)``'s stdout, checked. A run that ended in the intermittent failure is said
    aloud and run once more, which must pass in full (as tests/harness.py's rank pool does)."""
    result = launch(script, *args, **kwargs)
    if result.returncode != 0 and _INTERMITTENT.search(result.stderr):
        first = next(line for line in result.stderr.splitlines() if _INTERMITTENT.search(line))
        warnings.warn(f"{script}: {first.strip()}; running it again", RuntimeWarning, stacklevel=2)
        print(f"launch: {script}: {first.strip()}; running it again", file=sys.stderr, flush=True)
        RERUNS.append(f"{script}: {first.strip()}")
        result = launch(script, *args, **kwargs)
    return check(result)


def run_ranks(script: str, envs: list[dict[str, str]], *args: str, timeout: float = 120):
    """``script`` as one process per env (RANK, WORLD_SIZE, ... given per rank), started together: per rank,
    (exit code, output, seconds until it ended). A rank still running at ``timeout`` is killed: exit code None."""
    import time

    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, str(ROOT / script), *args], env=_env(e), cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for e in envs]
    results = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(timeout - (time.monotonic() - start), 1))
            results.append((p.returncode, out, time.monotonic() - start))
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            results.append((None, out, time.monotonic() - start))
    return results
