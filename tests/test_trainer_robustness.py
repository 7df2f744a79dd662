"""What users do to a run besides Ctrl-C: fill the disk, kill it mid-write of metrics.jsonl or
mid-rotation, hand it files of the wrong kind or encoding. Each gets one line naming the file,
the checkpoint or the field, and what a crash left behind is swept at the next start."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from tiny_train import sft_trainer

from pagedrl.model.loader import load_model
from pagedrl.model.staging import discard_folder, remove_hidden_leftovers, staged_folder
from pagedrl.train import checkpointing as ckpt
from pagedrl.train.cli import resume_command, train_main
from pagedrl.train.config import load_config
from pagedrl.train.data import DataError, DataReport, read_rows
from pagedrl.train.logging import read_metrics, truncate_metrics
from pagedrl.train.offline_config import SFTConfig

# -- a full disk --------------------------------------------------------------------------------


def test_full_disk_names_the_checkpoint_the_cause_and_the_space(tiny_train_model, tmp_path, monkeypatch) -> None:
    """The third save hits ENOSPC halfway through writing trainer_state.pt (what a full disk does
    to torch.save); the first two checkpoints stay complete and load."""
    trainer = sft_trainer(tiny_train_model, tmp_path, max_steps=6, save_steps=1)
    real_save = torch.save
    saves = []

    def filling_disk(obj, path, *args, **kwargs):
        saves.append(path)
        if len(saves) == 3:
            Path(path).write_bytes(b"PK\x03\x04" + b"\0" * 1000)  # part of it got written
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "save", filling_disk)
    free = 2**20 * 5  # more than a checkpoint takes: the up-front check passes, the write fails
    real_usage = shutil.disk_usage
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: real_usage(path)._replace(free=free))
    with pytest.raises(ckpt.CheckpointWriteError) as caught:
        trainer.train()
    assert str(caught.value) == (f"could not write {tmp_path / 'checkpoint-3'}: no space left on device (it needs more "
                                 f"than the 5.0 MiB free on {tmp_path}); the checkpoints already saved are intact "
                                 f"(latest: {tmp_path / 'checkpoint-2'})")
    assert isinstance(caught.value.__cause__, OSError) and caught.value.__cause__.errno == errno.ENOSPC
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [1, 2]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # the torn save is gone
    monkeypatch.undo()

    resumed = sft_trainer(tiny_train_model, tmp_path, max_steps=6, save_steps=1000, resume_from_checkpoint=True)
    resumed.train()
    assert resumed.step == 6
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    state = ckpt.load_trainer_state(tmp_path / "checkpoint-1")
    assert state["step"] == 1 and load_model(str(tmp_path / "checkpoint-1")).model is not None


def test_a_disk_too_full_for_the_last_checkpoint_fails_before_writing(tiny_train_model, tmp_path, monkeypatch) -> None:
    """A writer that hides the errno (torch's zip writer says `unexpected pos`) is never reached:
    with less free space than the previous checkpoint took, the save stops before its first byte."""
    trainer = sft_trainer(tiny_train_model, tmp_path, max_steps=4, save_steps=2)
    real_usage = shutil.disk_usage

    def nearly_full(path):
        usage = real_usage(path)
        if ckpt.latest_checkpoint(tmp_path) is None:
            return usage
        return usage._replace(free=1000)

    monkeypatch.setattr(ckpt.shutil, "disk_usage", nearly_full)
    with pytest.raises(ckpt.CheckpointWriteError) as caught:
        trainer.train()
    size = ckpt.folder_bytes(tmp_path / "checkpoint-2") / 2**20
    assert str(caught.value) == (f"could not write {tmp_path / 'checkpoint-4'}: no space left on device (it needs "
                                 f"about {size:.1f} MiB, 0.0 MiB free on {tmp_path}); the checkpoints already saved "
                                 f"are intact (latest: {tmp_path / 'checkpoint-2'})")
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "metrics.jsonl", "runs"]


def test_a_full_disk_through_the_command_line_is_one_line(tiny_train_model, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(ckpt, "_write_synced", _raise_enospc)
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "what is 1 plus 2", "completion": " 3"}\n' * 4)
    rc = train_main("sft", [f"model={tiny_train_model}", f"dataset={data}", f"output_dir={tmp_path / 'out'}",
                            "max_steps=1", "save_steps=1", "report_to=[jsonl]"])
    err = capsys.readouterr().err
    assert rc == 1
    last = err.strip().splitlines()[-1]  # after the progress bar
    assert re.fullmatch(rf"pagedrl sft: error: could not write {tmp_path}/out/checkpoint-1: no space left on device "
                        rf"\(it needs more than the \d+\.\d MiB free on {tmp_path}/out\); no earlier checkpoint",
                        last), last
    assert "Traceback" not in err


def _raise_enospc(path, text):
    raise OSError(errno.ENOSPC, "No space left on device", str(path))


# -- a signal during the last step ---------------------------------------------------------------


def test_a_signal_during_the_last_step_still_stops_and_saves(tiny_train_model, tmp_path) -> None:
    """Ctrl-C that arrives while the run's last step runs (the step budget, or the time budget, ends
    it) is not lost: the step is saved and the run raises, so a pipeline does not go on to its next
    stage; resuming then writes final/."""
    from pagedrl.train.interrupt import TrainingInterrupted

    trainer = sft_trainer(tiny_train_model, tmp_path, max_steps=2, save_steps=1000)
    real_run_step = trainer.run_step

    def signalled_during_step_2() -> None:
        real_run_step()
        if trainer.step == 2:
            trainer.stop.signum = 2  # what the SIGINT handler records

    trainer.run_step = signalled_during_step_2
    with pytest.raises(TrainingInterrupted):
        trainer.train()
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2] and not (tmp_path / "final").exists()
    resumed = sft_trainer(tiny_train_model, tmp_path, max_steps=2, save_steps=1000, resume_from_checkpoint=True)
    assert resumed.train() == tmp_path / "final" and ckpt.is_complete(tmp_path / "final")


# -- metrics.jsonl cut off mid-write ------------------------------------------------------------


def test_resume_drops_a_torn_last_metrics_line_and_says_so(tiny_train_model, tmp_path, capsys) -> None:
    first = sft_trainer(tiny_train_model, tmp_path, max_steps=4, save_steps=2)
    first.train()
    path = tmp_path / "metrics.jsonl"
    with path.open("a") as f:
        f.write('{"step": 5, "epoch": 1.25, "learning_rate": 0.003, "loss": 1.')  # killed mid-write
    resumed = sft_trainer(tiny_train_model, tmp_path, max_steps=6, save_steps=1000,
                          resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    resumed.train()
    out = capsys.readouterr().out
    assert f"{path}: dropped its last line 5, cut off mid-write" in out
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4, 5, 6]


def test_truncating_metrics_to_the_resumed_step(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3, 4)) + '{"step": 5, "lo')
    assert truncate_metrics(path, 2) == [
        f"{path}: dropped its last line 5, cut off mid-write ('{{\"step\": 5, \"lo'...)",
        f"{path}: dropped 2 row(s) after step 2; the resumed run writes them again"]
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    assert truncate_metrics(path, 2) == []  # nothing more to drop


def test_a_bad_metrics_line_before_the_end_is_named(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, oops}\n{"step": 3}\n')
    with pytest.raises(ValueError, match=rf"^{path}:2: not a JSON row \(Expecting property name enclosed in double "
                                         r"quotes at column 13\); fix or delete that line to resume$"):
        truncate_metrics(path, 3)
    with pytest.raises(ValueError, match=rf"^{path}:2: not a JSON row"):
        read_metrics(path)


# -- rotation interrupted, leftovers swept ------------------------------------------------------


def test_leftovers_of_a_killed_rotation_and_save_are_swept_at_start(tiny_train_model, tmp_path, capsys) -> None:
    first = sft_trainer(tiny_train_model, tmp_path, max_steps=4, save_steps=1, save_total_limit=2)
    first.train()
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [3, 4]
    # As the previous version's rotation left it when killed mid-delete: marker gone, some files too.
    half_deleted = tmp_path / "checkpoint-2"
    shutil.copytree(tmp_path / "checkpoint-3", half_deleted)
    (half_deleted / ckpt.COMPLETE_MARKER).unlink()
    (half_deleted / "model.safetensors").unlink()
    staging = tmp_path / ".checkpoint-5.partial-4242-abc123"  # a save killed midway
    shutil.copytree(tmp_path / "checkpoint-3", staging)
    deleting = tmp_path / ".checkpoint-1.deleting-4242-x_y"  # this version's rotation, killed midway
    deleting.mkdir()
    (deleting / "checkpoint-1").mkdir()
    old_format = tmp_path / ".checkpoint-6.partial-4242"  # the staging name of earlier versions
    old_format.mkdir()
    foreign = tmp_path / "checkpoint-500"  # another trainer's checkpoint: not ours to delete
    foreign.mkdir()
    (foreign / "optimizer.pt").write_bytes(b"\0")
    (foreign / "config.json").write_text("{}")

    resumed = sft_trainer(tiny_train_model, tmp_path, max_steps=6, save_steps=1, save_total_limit=2,
                          resume_from_checkpoint=True)
    resumed.train()
    out = capsys.readouterr().out
    assert "removed leftover    .checkpoint-1.deleting-4242-x_y (unfinished write or delete)" in out
    assert "removed leftover    .checkpoint-5.partial-4242-abc123 (unfinished write or delete)" in out
    assert "removed leftover    .checkpoint-6.partial-4242 (unfinished write or delete)" in out
    assert ("removed leftover    checkpoint-2 (no checkpoint_complete marker: an interrupted save or rotation)"
            in out)
    assert "checkpoint-500" not in out
    assert sorted(p.name for p in tmp_path.iterdir() if "checkpoint" in p.name) == [
        "checkpoint-5", "checkpoint-500", "checkpoint-6"]


def test_rotation_renames_before_deleting(tmp_path, monkeypatch) -> None:
    """Killed inside the file removal, a rotated checkpoint is already under a hidden name."""
    for step in (1, 2, 3):
        ckpt.write_checkpoint(tmp_path / f"checkpoint-{step}", lambda f: f.mkdir(), {"step": step}, {"step": step})

    def killed(path, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("pagedrl.model.staging.shutil.rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        ckpt.rotate_checkpoints(tmp_path, 2)
    monkeypatch.undo()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names[1:] == ["checkpoint-2", "checkpoint-3"] and names[0].startswith(".checkpoint-1.deleting-")
    assert ckpt.remove_leftovers(tmp_path) == [f"{names[0]} (unfinished write or delete)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-3"]


def test_a_replace_stopped_between_its_renames_keeps_the_old_folder(tmp_path, monkeypatch) -> None:
    """Re-saving `final/` moves the old folder aside, then renames the new one in: interrupted in
    between, the old folder goes back under its name, in the process or at the next start."""
    target = tmp_path / "final"
    with staged_folder(target) as folder:
        (folder / "weights").write_text("old")
    real, calls = os.replace, []

    def second_rename_interrupted(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(src, dst)

    monkeypatch.setattr("pagedrl.model.staging.os.replace", second_rename_interrupted)
    with pytest.raises(KeyboardInterrupt), staged_folder(target) as folder:
        (folder / "weights").write_text("new")
    monkeypatch.undo()
    assert (target / "weights").read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["final"]
    # killed outright at that moment: the old folder set aside, the new one still staged
    aside, staged = tmp_path / ".final.old-4242-ab", tmp_path / ".final.partial-4242-cd"
    aside.mkdir()
    staged.mkdir()
    os.replace(target, aside / "previous")
    assert remove_hidden_leftovers(tmp_path) == [aside, staged]
    assert (target / "weights").read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["final"]


def test_a_damaged_trainer_state_is_named(tmp_path) -> None:
    folder = ckpt.write_checkpoint(tmp_path / "checkpoint-1", lambda f: f.mkdir(), {"step": 1}, {"step": 1})
    state = folder / ckpt.TRAINER_STATE_PT
    state.write_bytes(state.read_bytes()[:100])
    with pytest.raises(ValueError, match=rf"^resume_from_checkpoint: {re.escape(str(state))} cannot be read"):
        ckpt.load_trainer_state(folder)


def test_discard_folder_of_a_missing_folder_is_a_no_op(tmp_path) -> None:
    discard_folder(tmp_path / "absent")
    assert list(tmp_path.iterdir()) == []


# -- bad input ----------------------------------------------------------------------------------


def test_non_utf8_dataset_row_is_named_and_skippable(tmp_path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"prompt": "a", "completion": "b"}\n{"prompt": "caf\xe9", "completion": "b"}\n'
                     b'{"prompt": "c", "completion": "d"}\n')
    with pytest.raises(DataError, match=rf"^{path}:2: row: not valid UTF-8 \(byte 0xe9 at byte 16 of the line\)$"):
        list(read_rows(path, DataReport(str(path))))
    report = DataReport(str(path))
    rows = list(read_rows(path, report, on_bad_row="skip"))
    assert [r.where for r in rows] == [f"{path}:1", f"{path}:3"]
    assert report.skipped == {"not UTF-8": 1} and report.first_skipped["not UTF-8"] == f"{path}:2"


def test_a_folder_as_dataset_is_named_as_such(tmp_path) -> None:
    with pytest.raises(DataError, match=rf"^dataset: {tmp_path} is a folder without Parquet or Arrow files; expected a JSONL"):
        list(read_rows(tmp_path, DataReport(str(tmp_path))))


def test_non_utf8_yaml_names_file_line_and_column(tmp_path) -> None:
    path = tmp_path / "config.yaml"
    path.write_bytes(b"learning_rate: 1.0e-3\n# r\xe9sum\xe9 of the run\nmax_steps: 3\n")
    with pytest.raises(ValueError, match=rf"^config file {path}:2: not valid UTF-8 \(byte 0xe9 at column 4\); "
                                         "save it as UTF-8$"):
        load_config(SFTConfig, path)
    with pytest.raises(ValueError, match=rf"^yaml_path: {tmp_path} is a folder; expected a YAML config file$"):
        load_config(SFTConfig, tmp_path)


def test_output_dir_that_is_a_file(tmp_path, capsys) -> None:
    blocker = tmp_path / "runs"
    blocker.write_text("not a folder")
    assert train_main("sft", [f"output_dir={blocker}"]) == 2
    assert capsys.readouterr().err.strip() == (f"pagedrl sft: error: output_dir: {blocker} is a file, not a folder "
                                              "(from command line)")
    with pytest.raises(ValueError, match=rf"output_dir: {blocker} is a file, not a folder"):
        SFTConfig(output_dir=str(blocker / "x"))


def test_resume_command_replaces_an_earlier_resume_and_quotes(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cmd = resume_command("dpo", ["c.yaml", "resume_from_checkpoint=old", "report_to=[jsonl]"], tmp_path / "checkpoint-7")
    assert cmd == f"pagedrl dpo c.yaml 'report_to=[jsonl]' resume_from_checkpoint={tmp_path}/checkpoint-7"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert resume_command("sft", [], "x").startswith("torchrun --nproc_per_node 2 -m pagedrl.cli sft ")


def test_eval_steps_without_anything_to_evaluate_is_refused(tiny_train_model, tmp_path) -> None:
    with pytest.raises(ValueError, match="eval_steps: 1 asks for evaluations, but there is nothing to evaluate"):
        sft_trainer(tiny_train_model, tmp_path, max_steps=1, eval_steps=1)


def test_a_checkpoint_of_another_algorithm_is_not_resumed(tiny_train_model, tmp_path) -> None:
    sft_trainer(tiny_train_model, tmp_path, max_steps=1, save_steps=1).train()
    other = sft_trainer(tiny_train_model, tmp_path, max_steps=2, resume_from_checkpoint=True)
    other.algorithm.name = "dpo"  # as a DPO run pointed at this SFT run's checkpoint
    with pytest.raises(ValueError, match=r"checkpoint-1 was written by sft, this run is dpo"):
        other.train()
