"""Checkpoints: Hugging Face folders transformers loads, complete only with their marker, never
half-written under a final name, rotated by save_total_limit, with the run's outputs beside them."""

from __future__ import annotations

import json
from pathlib import Path

import decoder_bound
import pytest
import torch
from tiny_train import sft_trainer

from pagedrl.train import checkpointing as ckpt


@pytest.fixture(scope="module")
def run(tiny_train_model, tmp_path_factory):
    """Four steps saving every step with save_total_limit=2, reporting to jsonl and TensorBoard."""
    out = tmp_path_factory.mktemp("run")
    trainer = sft_trainer(tiny_train_model, out, max_steps=4, save_steps=1, save_total_limit=2,
                          report_to=["jsonl", "tensorboard"])
    final = trainer.train()
    return trainer, out, final


def test_outputs_of_a_run(run) -> None:
    trainer, out, final = run
    assert final == out / "final" and ckpt.is_complete(final)
    assert [step for step, _ in ckpt.list_checkpoints(out)] == [3, 4]
    assert not (out / "checkpoint-1").exists() and not (out / "checkpoint-2").exists()
    assert list((out / "runs").glob("events.out.tfevents.*"))
    assert (out / "plots" / "loss.png").stat().st_size > 1000
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert {"step", "epoch", "learning_rate", "loss", "grad_norm", "mean_token_accuracy", "num_tokens",
            "entropy", "wall_time", "train_time"} <= rows[0].keys()
    summary = json.loads((out / "checkpoint-4" / ckpt.PAGEDRL_STATE_JSON).read_text())
    assert summary["step"] == summary["weight_version"] == 4 and summary["epoch"] == 1.0
    state = ckpt.load_trainer_state(out / "checkpoint-4")
    assert {"optimizer", "scheduler", "rng", "algorithm", "step", "weight_version"} <= state.keys()
    assert state["algorithm"]["stream"]["consumed"] == 16


def test_trainer_state_json_is_what_transformers_reads(run) -> None:
    """transformers' TrainerState.load_from_json takes it (the dataclass refuses unknown keys), with the
    step, the schedule of the run and the log rows up to that step as its Trainer keeps them."""
    from transformers import TrainerState

    _, out, _ = run
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for step in (3, 4):
        state = TrainerState.load_from_json(str(out / f"checkpoint-{step}" / ckpt.TRAINER_STATE_JSON))
        assert (state.global_step, state.max_steps, state.logging_steps, state.save_steps) == (step, 4, 1, 1)
        assert state.epoch == rows[step - 1]["epoch"] and state.train_batch_size == 4
        expected = [{k: v for k, v in r.items() if k not in ("wall_time", "train_time")} for r in rows[:step]]
        assert state.log_history == expected
        assert state.log_history[-1]["loss"] == rows[step - 1]["loss"]


@pytest.mark.parametrize("folder", ["checkpoint-4", "final"])
def test_checkpoint_loads_back_in_transformers(run, folder) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer, out, _ = run
    path = out / folder
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    hf_tok = AutoTokenizer.from_pretrained(str(path))
    text = "what is two plus three"
    ids = torch.tensor([hf_tok(text)["input_ids"]])
    assert ids[0].tolist() == trainer.algorithm.tokenizer.encode(text)
    with torch.no_grad():
        ours = trainer.module.logits(trainer.module(ids))
        theirs = hf(input_ids=ids).logits
    freq_error = (hf.model.rotary_emb.inv_freq.double() - trainer.module.model.inv_freq.double()).abs()
    probed = decoder_bound.logits(trainer.module, ids, freq_error=freq_error)
    for got in (ours, theirs):  # within float32's bound (~1e-5) of the exact logits of the saved weights
        assert ((got.double() - probed.exact).abs() <= probed.bound()).all()


def test_crash_while_saving_leaves_no_complete_looking_checkpoint(tiny_train_model, tmp_path, monkeypatch) -> None:
    trainer = sft_trainer(tiny_train_model, tmp_path, max_steps=2, save_steps=2)
    real_save = ckpt.torch.save

    def crash(obj, path, *args, **kwargs):  # weights and tokenizer are already written by now
        assert (path.parent / "model.safetensors").is_file()
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        trainer.train()
    monkeypatch.setattr(ckpt.torch, "save", real_save)
    assert not (tmp_path / "checkpoint-2").exists()
    assert ckpt.list_checkpoints(tmp_path) == [] and ckpt.latest_checkpoint(tmp_path) is None
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # staging removed
    with pytest.raises(ValueError, match="no complete checkpoint"):
        ckpt.resolve_resume(True, tmp_path)


def test_folder_without_marker_is_not_a_checkpoint(run, tmp_path) -> None:
    import shutil

    _, out, _ = run
    killed = tmp_path / "checkpoint-9"  # as if the process died between writing and the marker
    shutil.copytree(out / "checkpoint-4", killed)
    (killed / ckpt.COMPLETE_MARKER).unlink()
    shutil.copytree(out / "checkpoint-3", tmp_path / "checkpoint-3")
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "checkpoint-3"
    with pytest.raises(ValueError, match="incomplete"):
        ckpt.resolve_resume(str(killed), tmp_path)
    assert ckpt.resolve_resume(False, tmp_path) is None


def test_a_failed_replacement_keeps_the_old_checkpoint(tmp_path) -> None:
    def write(tag):
        def save(folder):
            folder.mkdir()
            (folder / "model.safetensors").write_text(tag)
        return save

    ckpt.write_checkpoint(tmp_path / "checkpoint-5", write("old"), {"step": 5}, {"step": 5})

    def broken(folder):
        write("new")(folder)
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        ckpt.write_checkpoint(tmp_path / "checkpoint-5", broken, {"step": 5}, {"step": 5})
    assert (tmp_path / "checkpoint-5" / "model.safetensors").read_text() == "old"
    assert ckpt.is_complete(tmp_path / "checkpoint-5")


def test_a_checkpoint_is_on_disk_before_it_has_its_name(tmp_path, monkeypatch) -> None:
    """A power loss after the rename must not find a checkpoint whose files never reached the disk:
    every file is fsynced before the marker and the rename, the parent after the rename."""
    from pagedrl.model import staging

    events: list[tuple[str, str]] = []
    real_fsync, real_replace, real_rename = staging.os.fsync, staging.os.replace, staging.os.rename

    def fsync(fd):
        events.append(("fsync", staging.os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def rename(kind, real):
        def moved(src, dst):
            events.append((kind, str(dst)))
            return real(src, dst)
        return moved

    monkeypatch.setattr(staging.os, "fsync", fsync)
    monkeypatch.setattr(ckpt.os, "fsync", fsync)
    monkeypatch.setattr(staging.os, "replace", rename("rename", real_replace))
    monkeypatch.setattr(staging.os, "rename", rename("rename", real_rename))

    def save(folder):
        (folder / "sub").mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"weights")
        (folder / "sub" / "tokenizer.json").write_text("{}")

    target = tmp_path / "checkpoint-1"
    for replacing in (False, True):  # a new folder, then a save over an existing one
        events.clear()
        ckpt.write_checkpoint(target, save, {"step": 1}, {"step": 1})
        published = [i for i, (kind, dst) in enumerate(events) if kind == "rename" and dst == str(target)]
        assert len(published) == 1, events
        synced_before = {Path(p).relative_to(p.split(".checkpoint-1.partial-")[0]).parts[1:]
                         for kind, p in events[:published[0]] if kind == "fsync" and ".partial-" in p}
        for name in ("model.safetensors", "sub/tokenizer.json", ckpt.TRAINER_STATE_PT, ckpt.TRAINER_STATE_JSON,
                     ckpt.COMPLETE_MARKER, "sub", ""):
            assert tuple(Path(name).parts) in synced_before, (name, replacing, events)
        synced = [p for kind, p in events if kind == "fsync"]
        marker = next(i for i, p in enumerate(synced) if p.endswith(ckpt.COMPLETE_MARKER))
        assert any(p.endswith("model.safetensors") for p in synced[:marker])  # data before its marker
        assert ("fsync", str(tmp_path)) in events[published[0]:]  # the rename itself on disk
