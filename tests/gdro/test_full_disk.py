"""A full disk while the run writes its outputs, on a real file system (a small tmpfs, tests/recipe_helpers/
small_disk.py): a metrics line that does not fit leaves the file as it was and stops the run with one line
naming ENOSPC and the file; torch's checkpoint writer, which names no errno (``unexpected pos ...``), is
recognised as a full disk; a failed save's step folder is removed and verl's marker left as it was. (The
launch whose first checkpoint does not fit: tests/gdro/test_cluster_faults.py.)"""

from __future__ import annotations

import pytest
import torch
from recipe_helpers.small_disk import fill, small_disk

from recipe.gdro.checkpoints import TRACKER_FILE, StorageFullError, discard_failed_save, storage_full
from recipe.gdro.results.metrics_io import append_metrics_jsonl


def test_a_metrics_line_that_does_not_fit_stops_the_run_in_one_line_and_leaves_the_file(tmp_path):
    with small_disk(tmp_path / "disk", "256k") as disk:
        path = disk / "gdro_metrics.jsonl"
        append_metrics_jsonl(path, 1, {"gdro/x": 1.0})
        before = path.read_bytes()
        fill(disk)
        with pytest.raises(StorageFullError) as e:
            append_metrics_jsonl(path, 2, {f"gdro/x{i}": float(i) for i in range(2000)})  # > one page
        text = str(e.value)
        assert "\n" not in text
        assert text.startswith(f"writing the metrics file {path} failed: ENOSPC (No space left on device)")
        assert path.read_bytes() == before


def test_a_checkpoint_write_that_does_not_fit_is_named_and_its_folder_removed(tmp_path):
    with small_disk(tmp_path / "disk", "512k") as disk:
        done = disk / "global_step_1"
        (done / "actor").mkdir(parents=True)
        (done / "actor" / "model.pt").write_bytes(b"x")
        (done / "data.pt").write_bytes(b"x")
        (disk / TRACKER_FILE).write_text("1")
        failing = disk / "global_step_2" / "actor"
        failing.mkdir(parents=True)
        with pytest.raises(Exception) as e:  # torch's zip writer: a RuntimeError ("unexpected pos ...")
            torch.save(torch.zeros(1 << 20), failing / "model.pt.tmp")
        why = storage_full(e.value, str(failing))
        assert why is not None and why.startswith("ENOSPC"), (type(e.value), str(e.value)[:300])
        line = discard_failed_save(str(disk), 2, folder_existed=False, marker_before=b"1", why=why)
        assert not (disk / "global_step_2").exists()
        assert (disk / TRACKER_FILE).read_text() == "1"
        assert "\n" not in line
        assert line.startswith("no room to save the checkpoint of step 2: ENOSPC")
        assert f"the last complete checkpoint is {done}" in line
    assert storage_full(RuntimeError("unrelated"), str(tmp_path)) is None
