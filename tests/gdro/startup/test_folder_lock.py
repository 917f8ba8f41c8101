"""One run per output folder (recipe/gdro/startup/folder_lock.py), with real processes: a live holder refuses
a second one in one line naming its pid and host; a holder killed with SIGKILL leaves a lock file that does not
block the next launch. (The launch-level test, two CPU-backend launches into one folder, is in
tests/gdro/test_cluster_faults.py.)"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from recipe_helpers.paths import REPO

from recipe.gdro.startup.folder_lock import LOCK_FILE, folder_holder

HOLD = (
    "import sys, time\n"
    "from recipe.gdro.startup.folder_lock import lock_output_folder\n"
    "lock_output_folder(sys.argv[1])\n"
    "print('locked', flush=True)\n"
    "time.sleep(120)\n"
)
TAKE = (
    "import sys\n"
    "from recipe.gdro.startup.folder_lock import FolderInUse, lock_output_folder\n"
    "try:\n"
    "    lock_output_folder(sys.argv[1])\n"
    "except FolderInUse as e:\n"
    "    print(e, file=sys.stderr)\n"
    "    sys.exit(2)\n"
    "print('locked')\n"
)


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def test_a_live_holder_refuses_a_second_process_and_a_killed_one_does_not(tmp_path):
    folder = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True, env=_env(), cwd=REPO
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert folder_holder(str(folder)).startswith(f"pid {holder.pid} on host {socket.gethostname()}")
        second = subprocess.run(
            [sys.executable, "-c", TAKE, str(folder)], capture_output=True, text=True, env=_env(), cwd=REPO
        )
        assert second.returncode == 2, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1, second.stderr
        assert f"in use by another launch (pid {holder.pid} on host {socket.gethostname()}" in lines[0]
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
    # the dead holder's lock file is still there, and blocks nothing
    assert (folder / LOCK_FILE).is_file()
    assert folder_holder(str(folder)) is None
    t0 = time.monotonic()
    third = subprocess.run(
        [sys.executable, "-c", TAKE, str(folder)], capture_output=True, text=True, env=_env(), cwd=REPO
    )
    assert third.returncode == 0 and third.stdout.strip() == "locked", third.stderr
    assert time.monotonic() - t0 < 30
