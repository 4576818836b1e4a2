"""One owner of what a run resumes from: every checkpointed part that a save writes, a resume
restores.

Oracle: the checkpoint itself.  A run saves a mid-epoch checkpoint; a fresh run restores it and
at once saves again, without training: every file of the second checkpoint must equal the first
byte for byte.  A part that is saved but not restored writes the fresh run's value the second
time (and differs); a part restored but never saved finds no file and fails the restore.  No list
of parts is repeated here: the test reads the trainer's own.
"""

from __future__ import annotations

import hashlib

from accel_train.run.checkpoint import MANIFEST
from accel_train.cli import build_train_parser, config_from_args
from accel_train.trainer import Trainer
from conftest import TINY_TRAIN

# Accelerate's own files (torch.save, loaded with weights_only=True): everything else a part
# writes must be plain JSON or safetensors.
ACCELERATE_FILES = {"optimizer.bin", "scheduler.bin", "scaler.pt", "random_states_0.pkl"}


def _config(*args: str):
    return config_from_args(build_train_parser().parse_args([*TINY_TRAIN, *args]), environ={})


def _digests(folder) -> dict[str, str]:
    """Each file's SHA-256, but Accelerate's RNG files: they record the global generators at the
    moment of the save, which nothing relies on (every draw is seeded by its place in the run;
    the resume matrix shows exactness without them)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()
            if p.is_file() and p.name != MANIFEST and not p.name.startswith("random_states_")}


def test_every_part_a_checkpoint_holds_comes_back_from_it(tmp_path, fresh_accelerate):
    options = ["--model-ema", "--model-ema-decay", "0.9", "--drop-path", "0.1", "--mixup", "0.8"]
    first = Trainer.from_config(_config(*options, "--max-steps", "5", "--checkpoint-every", "3",
                                        "--output-dir", str(tmp_path / "first")))
    try:
        assert first.train() == 0
        parts = [part.name for part in first.checkpointer.parts]
    finally:
        first.close()
    saved = tmp_path / "first" / "checkpoints" / "step_00000003"  # mid-epoch (16 steps each)

    second = Trainer.from_config(_config(*options, "--max-steps", "5", "--checkpoint-every", "3",
                                         "--output-dir", str(tmp_path / "second"),
                                         "--resume", str(saved)))
    try:
        assert [part.name for part in second.checkpointer.parts] == parts
        assert second.state.step == 3 and second.train_loader.samples_in_epoch == 3 * 16
        again = second.save_checkpoint()
    finally:
        second.close()

    before, after = _digests(saved), _digests(again)
    assert before.keys() == after.keys()
    differing = sorted(name for name in before if before[name] != after[name])
    assert not differing, f"saved but not restored: {differing} (parts: {parts})"
    foreign = {name for name in before if not name.endswith((".json", ".safetensors"))}
    assert foreign <= ACCELERATE_FILES, foreign
    assert {"ema.safetensors", "loader.json", "schedule.json", "trainer_state.json",
            "model_config.json", "bad_images.json", "model.safetensors"} <= set(before)


def test_accelerates_part_resumes_with_and_without_a_loss_scaler(tmp_path, fresh_accelerate):
    """fp16 (a loss scaler) resumed from a checkpoint written without one (fp32, bf16, a CPU)
    starts its scaler afresh instead of failing on the missing scaler.pt; one written with a
    scaler gives it back its scale; one without a scaler ignores a saved scaler.  A CPU shows it:
    torch's GradScaler("cpu") takes the place of the one fp16 on CUDA would make."""
    import torch
    from accelerate import Accelerator

    from accel_train.run.checkpoint import AccelerateState

    acc = Accelerator(cpu=True)
    model, optimizer = acc.prepare(torch.nn.Linear(4, 2), torch.optim.SGD(
        torch.nn.Linear(4, 2).parameters(), lr=0.1))
    warnings = []
    part = AccelerateState(acc, warnings.append, models=[model])
    plain = tmp_path / "plain"
    part.save(plain)
    assert not (plain / "scaler.pt").exists()

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    acc.scaler = scaler
    part.load(plain)  # no scaler.pt: the scaler is kept as it was
    assert acc.scaler is scaler and scaler.get_scale() == 2.0 ** 10

    scaler.scale(torch.ones(1))  # (its state starts at the first scaled loss)
    scaler.update(2.0 ** 7)  # a scale the run found
    scaled = tmp_path / "scaled"
    part.save(scaled)
    assert (scaled / "scaler.pt").is_file()
    acc.scaler = fresh = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    part.load(scaled)
    assert acc.scaler is fresh and fresh.get_scale() == 2.0 ** 7

    acc.scaler = None
    part.load(scaled)  # a run without a scaler passes over the saved one
    assert acc.scaler is None


def test_evaluating_leaves_a_compiled_ddp_model_wrapped_as_it_was(tmp_path, fresh_accelerate):
    """--compile on several processes trains through compile(DDP(model)).  Evaluation must use
    the bare model without re-pointing the compiled wrapper (Accelerate's unwrap_model does that
    by default), or every later training step would bypass DDP.  Shown in one process: a
    one-rank gloo group for DDP, and torch.compile's wrapper, which compiles nothing until it
    is called."""
    import torch
    import torch.distributed as dist

    args = build_train_parser().parse_args([*TINY_TRAIN, "--max-steps", "1", "--output-dir",
                                            str(tmp_path / "run")])
    trainer = Trainer.from_config(config_from_args(args))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(trainer.net.model)
        trainer.model = compiled = torch.compile(ddp)
        trainer.evaluate()
        assert compiled._orig_mod is ddp and trainer.bare_model() is trainer.net.model
    finally:
        dist.destroy_process_group()
        trainer.close()
