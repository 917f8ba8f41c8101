"""Signals and zero-work inputs: every command, interrupted by SIGINT or SIGTERM once it
is running, ends within seconds with one line on stderr, no traceback, exit 128 + signal, no process of
its tree left, and nothing half-written; a request for no work is refused up front (exit 2, one line).

Each test starts the real command as a subprocess in its own session (so every process it starts can be
found afterwards by its process group) and sends the signal to the command's process only, as ``kill``
does; the shared handling is :mod:`verl_ext.interrupt`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from recipe_helpers.paths import REPO

PY = sys.executable


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def start(argv: list[str], cwd: Path = REPO) -> subprocess.Popen:
    # Default SIGINT handling in the child even when pytest runs in the background (a shell then sets
    # SIGINT to ignored, and the child would inherit that).
    return subprocess.Popen(
        argv,
        cwd=cwd,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def wait_for(proc: subprocess.Popen, ready, timeout: float = 240.0, what: str = "") -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the command ended (exit {proc.returncode}) before {what}: {err[-2000:]}")
        if ready():
            return
        time.sleep(0.2)
    pytest.fail(f"not {what} within {timeout} s")


def descendants(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        return []


def group_members(pgid: int) -> list[int]:
    found = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p.pid)
        except (psutil.Error, ProcessLookupError):
            pass
    return found


def interrupt(proc: subprocess.Popen, sig: int, within: float) -> str:
    """Send ``sig``; assert the contract (module docstring); return stderr."""
    tree = descendants(proc)
    sent = time.time()
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=within + 30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        pytest.fail(f"still running {within + 30:.0f} s after {signal.Signals(sig).name}: {err[-3000:]}")
    took = time.time() - sent
    time.sleep(0.3)
    left = [p.pid for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    left += [pid for pid in group_members(proc.pid) if pid not in left]
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 128 + sig, (proc.returncode, err[-3000:])
    assert took < within, (took, err[-3000:])
    assert "Traceback" not in err and "Error" not in err.split("interrupted")[-1], err[-3000:]
    assert err.count("interrupted (") == 1, err[-3000:]
    assert f"interrupted ({signal.Signals(sig).name})" in err.strip().splitlines()[-1], err[-3000:]
    assert not left, f"processes left behind: {left}"
    return err


def cleanup(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


# ------------------------------------------------------------------ a command with no children
def test_data_prep_interrupted_mid_conversion_writes_nothing(tmp_path):
    """``python data_prep/dapo.py`` (SIGINT printed a traceback): interrupted while converting, it leaves no
    train.parquet and no temporary file."""
    src = tmp_path / "big.jsonl"
    with open(src, "w") as f:
        for i in range(150_000):
            f.write(json.dumps({"prompt": f"Compute {i} + {i * 7 % 13}.", "solution": str(i + i * 7 % 13)}) + "\n")
    out = tmp_path / "out"
    proc = start([PY, str(REPO / "data_prep" / "dapo.py"), "--local_dir", str(out), "--input", str(src)])
    try:

        def reading() -> bool:
            try:
                return any(f.path == str(src) for f in psutil.Process(proc.pid).open_files())
            except psutil.Error:
                return False

        wait_for(proc, reading, what="reading its input")
        interrupt(proc, signal.SIGINT, within=5)
    finally:
        cleanup(proc)
    assert not out.exists() or not any(out.iterdir()), sorted(out.iterdir())


def test_simulator_interrupted_during_its_imports(tmp_path):
    """``python -m recipe.gdro.lab.sim.simulate``: SIGINT while it is still importing (numpy, scipy, verl)."""
    out = tmp_path / "sim"
    proc = start([PY, "-m", "recipe.gdro.lab.sim.simulate", "--out", str(out), "--steps", "50", "--quiet"])
    try:
        time.sleep(1.5)  # the handler is in place after ~0.3 s; verl's import alone takes several seconds
        assert proc.poll() is None
        interrupt(proc, signal.SIGINT, within=5)
    finally:
        cleanup(proc)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no output folder, no partial sibling


# ------------------------------------------------------------------ commands with worker pools
@pytest.mark.parametrize(
    "argv, sig",
    [
        (["-m", "recipe.gdro.lab.experiments.sweep", "tune", "--quiet"], signal.SIGTERM),
        (["-m", "recipe.gdro.lab.experiments.study", "primary", "--jobs", "2"], signal.SIGINT),
    ],
    ids=["sweep-TERM", "study-INT"],
)
def test_pool_commands_stop_their_workers(tmp_path, argv, sig):
    """``sweep tune`` (TERM orphaned its 2 workers) and ``study primary`` (SIGINT ignored for minutes: the
    pool's ``with`` waited for every queued run): interrupted once both workers run, each stops at once
    and no worker survives; no report, table or tuned-lr file is written."""
    out = tmp_path / "out"
    extra = ["--table", str(tmp_path / "tuned.json")] if "sweep" in argv[1] else []
    extra = ["--results" if "study" in argv[1] else "--out", str(out), *extra]
    proc = start([PY, *argv, *extra])
    try:
        wait_for(proc, lambda: len(descendants(proc)) >= 2, what="running its two workers")
        time.sleep(1.0)
        interrupt(proc, sig, within=6)
    finally:
        cleanup(proc)
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert written == [], written


def test_quickstart_interrupted_stops_its_training_run(tmp_path):
    """``quickstart``: a rerun over a previous complete result, SIGINT after its first training step (its
    cpu_backend_tiny.sh -> main_gdro, Ray); the run and everything it started are stopped, and the previous
    result is as it was (before: the rerun had deleted its metrics and written 1 step of 3 there, while its
    report still described the old run). Its partial run is beside it, in <out>.partial."""
    out = tmp_path / "qs"
    (out / "grpo").mkdir(parents=True)
    (out / "grpo" / "gdro_metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in range(1, 31)))
    (out / "report.md").write_text("# the previous run: 30 steps\n")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    proc = start([PY, "-m", "recipe.gdro.lab.experiments.quickstart", "--out", str(out), "--steps", "3"])
    partial = tmp_path / "qs.partial" / "grpo" / "gdro_metrics.jsonl"
    try:

        def first_step() -> bool:
            for path in (partial, out / "grpo" / "gdro_metrics.jsonl"):  # the latter: where it went before
                if path.exists() and path.read_bytes() != before.get(path) and b'{"step": 1' in path.read_bytes():
                    return True
            return False

        wait_for(proc, first_step, what="training its first step")
        err = interrupt(proc, signal.SIGINT, within=15)
    finally:
        cleanup(proc)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert err.strip().splitlines()[-1] == (
        f"quickstart: interrupted (SIGINT); stopped its runs; {out} is as it was, the partial runs are in "
        f"{tmp_path / 'qs.partial'}"
    )


def _run_script(script: str, cwd: Path = REPO, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    r = subprocess.run([PY, "-c", script], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    return r, time.monotonic() - t0


# main() gets a signal, and a library does {then} with the interrupt it raised
_AFTER_SIGNAL = (
    "import os, signal, time\n"
    "from verl_ext.interrupt import run_main\n"
    "def main():\n"
    "    try:\n"
    "        os.kill(os.getpid(), signal.{sig})\n"
    "        signal.pause()\n"
    "    except KeyboardInterrupt:\n"
    "        {then}\n"
    "run_main('prog', main, deadline=2.0)\n"
)


def test_sigterm_stays_sigterm_when_a_library_reraises_a_plain_keyboard_interrupt():
    """Ray's ray.get turns the handler's Interrupted into a plain KeyboardInterrupt: the command still
    reports SIGTERM and exits 143 (before: 'interrupted (SIGINT)', exit 130, on the GPU launch path)."""
    r, _ = _run_script(_AFTER_SIGNAL.format(sig="SIGTERM", then="raise KeyboardInterrupt('ray.get') from None"))
    assert r.returncode == 143 and r.stderr.strip() == "prog: interrupted (SIGTERM); stopped", r.stderr


@pytest.mark.parametrize(
    "then", ["raise RuntimeError('the actor died') from None", "return 1"], ids=["wrapped", "returned"]
)
def test_an_interrupt_a_library_turns_into_an_error_or_a_return_still_ends_as_the_signal(then):
    """The GPU launch path, SIGINT under load, once ended with exit 1 and no line (its /dev/shm segments left):
    whatever comes out of main after the signal, the command ends as interrupted, exit 130, one line."""
    r, _ = _run_script(_AFTER_SIGNAL.format(sig="SIGINT", then=then))
    assert r.returncode == 130 and r.stderr.strip() == "prog: interrupted (SIGINT); stopped", r.stderr


def test_an_interrupt_a_library_swallows_ends_at_the_deadline():
    """main catches the interrupt and goes on working: the watchdog ends the command ``deadline`` s after the
    signal, with the one line and 128 + signal (before: it ran on)."""
    r, seconds = _run_script(_AFTER_SIGNAL.format(sig="SIGTERM", then="time.sleep(120)"))
    assert r.returncode == 143 and r.stderr.strip() == "prog: interrupted (SIGTERM); stopped", r.stderr
    assert 2.0 <= seconds < 20, seconds


def test_an_error_after_the_signal_passes_hydra_as_the_interrupt(tmp_path):
    """main_gdro's run under Hydra's job runner: an error the signal caused (a Ray actor stopped under it)
    leaves through errors_as_interrupt as the interrupt, so Hydra prints no failed job (before: Hydra's
    'Error executing job' and its traceback, exit 1)."""
    script = (
        "import os, signal, sys\n"
        "import hydra\n"
        "from verl_ext.interrupt import errors_as_interrupt, run_main\n"
        "@hydra.main(config_path=None, config_name=None, version_base=None)\n"
        "def job(config):\n"
        "    with errors_as_interrupt():\n"
        "        try:\n"
        "            os.kill(os.getpid(), signal.SIGINT)\n"
        "            signal.pause()\n"
        "        except KeyboardInterrupt:\n"
        "            raise RuntimeError('the actor died') from None\n"
        "sys.argv = [sys.argv[0], 'hydra.run.dir=.', 'hydra.output_subdir=null']\n"
        "run_main('prog', job)\n"
    )
    r, _ = _run_script(script, cwd=tmp_path)  # Hydra's job log goes to the working folder
    assert r.returncode == 130 and r.stderr.strip() == "prog: interrupted (SIGINT); stopped", r.stderr


def test_clean_up_after_children_stopped_runs_at_a_signal_unless_taken_back():
    """main_gdro removes its run's /dev/shm segments through after_children_stopped: interrupted_exit calls
    the registered clean-up once the children are stopped (before the one line), and a clean-up taken back
    (the run released them itself) is not called."""
    script = (
        "import os, signal, sys\n"
        "from verl_ext.interrupt import after_children_stopped, run_main\n"
        "def main():\n"
        "    after_children_stopped(lambda: print('cleaned', file=sys.stderr))\n"
        "    after_children_stopped(lambda: print('taken back', file=sys.stderr))()\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    signal.pause()\n"
        "run_main('prog', main)\n"
    )
    r = subprocess.run([PY, "-c", script], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 143, r.stderr
    assert r.stderr.strip().splitlines() == ["cleaned", "prog: interrupted (SIGTERM); stopped"]


@pytest.mark.slow
def test_cpu_backend_run_interrupted_mid_training(tmp_path):
    """``python -m recipe.gdro.main_gdro gdro.backend=cpu`` (cpu_backend_tiny.sh; SIGINT printed 181 traceback
    blocks: asyncio tasks destroyed while pending, ContextVar tokens reset in another context): SIGINT
    once a training step has been written. The agent loop's tasks are cancelled, TransferQueue and Ray
    shut down, one line, exit 130, no Ray process left."""
    data = tmp_path / "data"
    subprocess.run(
        [PY, "-m", "data_prep.arith", "--local_dir", str(data), "--num_train", "128", "--num_val", "32", "--seed", "0"],
        cwd=REPO,
        env=_env(),
        check=True,
        capture_output=True,
    )
    out = tmp_path / "run"
    env_cmd = ["bash", str(REPO / "run_scripts" / "cpu_backend_tiny.sh"), "trainer.val_before_train=false"]
    proc = subprocess.Popen(
        env_cmd,
        cwd=REPO,
        env=dict(_env(), DATA_DIR=str(data), OUT_DIR=str(out), METHOD="joint_gdro"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        metrics = out / "gdro_metrics.jsonl"
        wait_for(proc, lambda: metrics.exists() and metrics.stat().st_size > 0, timeout=400, what="a training step")
        time.sleep(0.5)  # into the next step's generation
        interrupt(proc, signal.SIGINT, within=15)
    finally:
        cleanup(proc)


# ------------------------------------------------------------------ zero-work and impossible outputs
def _refusals(tmp_path: Path) -> list[tuple[list[str], str]]:
    plain = tmp_path / "plain"
    return [
        (["-m", "recipe.gdro.lab.experiments.quickstart", "--steps", "0", "--out", str(tmp_path / "q")], "--steps 0"),
        (["-m", "recipe.gdro.lab.experiments.quickstart", "--out", str(plain / "q")], f"{plain} is a file"),
        (
            ["-m", "recipe.gdro.lab.experiments.sweep", "tune", "--steps", "0", "--out", str(tmp_path / "s")],
            "--steps 0",
        ),
        (["-m", "recipe.gdro.lab.experiments.study", "--results", str(tmp_path / "st"), "report"], "no runs folder"),
        (
            ["-m", "recipe.gdro.lab.experiments.study", "--results", str(tmp_path / "st"), "--jobs", "0", "primary"],
            "--jobs",
        ),
        (["-m", "recipe.gdro.lab.sim.simulate", "--out", str(plain / "x"), "--steps", "5"], f"{plain} is a file"),
    ]


def test_zero_work_and_impossible_outputs_are_refused_up_front(tmp_path):
    """``--steps 0`` (quickstart started Ray and hung; sweep ran every scenario's full length), ``--jobs 0``
    and ``study report`` without a cache (both left an empty cache/), ``--out`` under a plain file
    (NotADirectoryError, "File exists"): exit 2 with one line naming the value, nothing created."""
    (tmp_path / "plain").write_text("x")
    for argv, fragment in _refusals(tmp_path):
        proc = subprocess.run([PY, *argv], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, (argv, proc.stderr[-2000:])
        assert len(lines) == 1 and fragment in lines[0] and "Traceback" not in proc.stderr, (argv, proc.stderr)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["plain"], (argv, sorted(tmp_path.iterdir()))
        assert (tmp_path / "plain").read_text() == "x"
