"""The trainer's own state in every checkpoint (trainer_state.json, plain JSON): where the run
stands (step, epoch, samples), what it was trained on and how (seed, set sizes, which images a
sample limit kept, how the validation split was carved), and its evaluations (the numbers
--keep-best and the final model's choice read).  A resume takes it whole but for what each start
decides for itself, after the checks that refuse a checkpoint of other data or another choice
of the best.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Optional

from accel_train.base.errors import RunDiffers
from accel_train.base.readers import read_json
from accel_train.train.selection import (WORDS, best_of, check_same_eval_metric, describe,
                                         rank)

STATE_FILE = "trainer_state.json"


@dataclass
class TrainerState:
    """Where the run is: enough to continue it exactly, or on another number of processes."""

    step: int = 0                 # optimizer steps taken
    epoch: int = 0                # current epoch (0-based)
    samples_in_epoch: int = 0     # samples of this epoch already consumed, all processes together
    samples_seen: int = 0
    world_size: int = 1
    batch_size: int = 0           # per process
    accumulation_steps: int = 1
    seed: int = 0
    train_samples: int = 0        # N in the sampler's keys (epoch * N + index); 0: not recorded
    held_out_samples: int = 0     # the images its evaluations counted, and the test split's:
    test_samples: int = 0         # a resume on others would compare numbers of other sets
    best_top1: Optional[float] = None
    eval_top1: Optional[float] = None  # the last held-out evaluation: raw weights
    eval_step: Optional[int] = None    # the step it was made at
    ema_top1: Optional[float] = None   # and EMA weights (--model-ema)
    # --eval-metric and its numbers (train/selection.py): the last evaluation's of the raw and
    # the EMA weights, and the best so far; None: a checkpoint from before the option, which
    # picked by top-1 (the *_top1 fields above)
    eval_metric: Optional[str] = None
    eval_score: Optional[float] = None
    ema_score: Optional[float] = None
    best_score: Optional[float] = None
    precision: Optional[str] = None    # what the run computes in (Accelerate's name: no, bf16,
    channels_last: Optional[bool] = None  # fp16) and its memory format: a resume keeps them
    optimizer: Optional[str] = None    # the --optimizer whose state the checkpoint holds
    decoded_on_device: Optional[bool] = None  # --decode-on-device's choice: a resume keeps it
    # decoded on the device: the share of each batch's JPEGs the loader workers decode
    # (--host-decode-share, or auto's), which a resume keeps (it decides those images' pixels)
    host_decode_share: Optional[float] = None
    # photographs: whether --data-on-device held them decoded on the device (auto's choice, a
    # resume keeps it: their pixels are the device's crops, not the loader workers'); None for
    # other data, or where nothing was chosen
    photos_held: Optional[bool] = None
    # which images a sample limit kept: 'random' or 'first' (--sample-subset), 'all' where no
    # limit cut a split; None: a checkpoint from before the option, whose limits kept the first
    sample_subset: Optional[str] = None
    # how the held-out images were carved off the training split: 'random' or 'stratified'
    # (--val-stratify), None where nothing was carved or before the option (a random draw)
    held_out_carve: Optional[str] = None

    # What a start decides for itself, not taken from the checkpoint: its process layout (the
    # global batch is kept: resume.keep_global_batch), and how it computes (autotune.py: a
    # resumed run asks for the checkpoint's choice, unless told otherwise).
    THIS_START = ("world_size", "batch_size", "accumulation_steps", "precision", "channels_last",
                  "decoded_on_device", "host_decode_share", "photos_held")

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size * self.accumulation_steps

    def to_json(self) -> dict:
        return {**asdict(self), "global_batch": self.global_batch}

    def continued_on(self, **this_start) -> "TrainerState":
        """This state, taken whole, as the run goes on with this start's own THIS_START fields
        (another process layout, say).  Whole, so a field added later is never dropped."""
        if set(this_start) != set(self.THIS_START):
            raise TypeError(f"continued_on needs exactly {self.THIS_START}")
        return replace(self, **this_start)

    def note_evaluation(self, record: dict) -> None:
        """An epoch end's evaluation (its record's eval_top1, and eval_ema_top1 with
        --model-ema), made at this step.  The best counts both: the EMA weights are the ones
        saved when they are the better."""
        self.best_top1 = max(record["eval_top1"], record.get("eval_ema_top1", 0.0),
                             self.best_top1 or 0.0)
        self.eval_top1, self.eval_step = record["eval_top1"], self.step
        if "eval_ema_top1" in record:
            self.ema_top1 = record["eval_ema_top1"]
        metric = self.metric
        self.eval_score = record[f"eval_{metric}"]
        self.ema_score = record.get(f"eval_ema_{metric}", self.ema_score)
        self.best_score = best_of(metric, self.eval_score, record.get(f"eval_ema_{metric}"),
                                  self.best_score)

    @property
    def metric(self) -> str:
        return self.eval_metric or "top1"

    def scores(self) -> tuple[Optional[float], Optional[float]]:
        """The last evaluation's --eval-metric of the raw and the EMA weights."""
        if self.eval_metric is None:  # from before the option: its numbers are the top-1's
            return self.eval_top1, self.ema_top1
        return self.eval_score, self.ema_score

    def ema_is_better(self) -> bool:
        raw, ema = self.scores()
        return ema is not None and rank(self.metric, ema) > rank(self.metric, raw)

    def best_words(self) -> str:
        """'best held-out top-1 93.10%', or of the --eval-metric the run picked by."""
        if self.eval_metric in (None, "top1"):
            return f"best held-out top-1 {self.best_top1 or 0:.2%}"
        if self.best_score is None:
            return f"best held-out {WORDS[self.metric]}: none (not evaluated)"
        return f"best held-out {describe(self.metric, self.best_score)}"

    @classmethod
    def from_json(cls, data: dict) -> "TrainerState":
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})

    # -- a checkpointed part ----------------------------------------------------------------
    name = "trainer_state"

    def save(self, folder: Path) -> None:
        (Path(folder) / STATE_FILE).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    def load(self, folder: Path) -> None:
        """Take the checkpoint's state whole, in place, but for what this start decides for
        itself (THIS_START)."""
        previous = read_state(folder)
        check_same_data_order(previous, self.seed, self.train_samples)
        check_same_held_out(previous, self.held_out_samples, self.test_samples)
        check_same_subset(previous, self.sample_subset)
        check_same_carve(previous, self.held_out_carve)
        check_same_eval_metric(previous.eval_metric, self.metric)
        continued = previous.continued_on(**{name: getattr(self, name)
                                             for name in self.THIS_START})
        for field in fields(self):
            setattr(self, field.name, getattr(continued, field.name))


def check_same_data_order(previous: TrainerState, seed: int, train_samples: int) -> None:
    """The epoch's order is a function of the seed and the training set: with either changed,
    skipping the samples already used would skip other ones, and some would be used twice."""
    if previous.seed != seed:
        raise RunDiffers(f"the checkpoint was trained with --seed {previous.seed}; resume with "
                         f"the same seed (got {seed}), or start a new run")
    if previous.train_samples and train_samples and previous.train_samples != train_samples:
        raise RunDiffers(f"the checkpoint was trained on {previous.train_samples} training "
                         f"images but this start has {train_samples} "
                         f"({_more_or_fewer(train_samples - previous.train_samples)}): images "
                         f"were added to or removed from the data since, or its options "
                         f"changed (--max-train-samples, --val-fraction, ...); resume on the same "
                         f"images with the same options, or start a new run (--pretrained "
                         f"RUN/model.safetensors goes on from its weights)")


def _more_or_fewer(difference: int) -> str:
    return f"{difference} more" if difference > 0 else f"{-difference} fewer"


def check_same_held_out(previous: TrainerState, held_out_samples: int,
                        test_samples: int) -> None:
    """The best checkpoint, --keep-best and the numbers a run reports compare evaluations: on
    another held-out set (--max-eval-samples changed, or the data) they would compare
    different things, and the run's records would no longer say what was measured."""
    for what, before, now in (("held-out", previous.held_out_samples, held_out_samples),
                              ("test", previous.test_samples, test_samples)):
        if before and now and now != before:  # 0: not recorded (a checkpoint before these)
            raise RunDiffers(f"the checkpoint's run evaluated {before} {what} images but this "
                             f"start has {now} ({_more_or_fewer(now - before)}); resume with the "
                             f"same data options (--max-eval-samples, the data's splits) on the "
                             f"same images, or start a new run")


def check_same_subset(previous: TrainerState, sample_subset: Optional[str]) -> None:
    """The same number of images kept by another rule are other images: the epoch's order
    would skip and repeat other ones, and the evaluations would measure another set."""
    if sample_subset in (None, "all") or previous.sample_subset == "all":
        return  # one of the two kept whole splits (the counts differ, and say so), or unknown
    before = previous.sample_subset or "first"
    if before != sample_subset:
        raise RunDiffers(f"the checkpoint's run kept its sample limits' images by "
                         f"--sample-subset {before}, this start by {sample_subset}: they are "
                         f"other images; resume with --sample-subset {before}, or start a new "
                         f"run")


def check_same_carve(previous: TrainerState, held_out_carve: Optional[str]) -> None:
    """As many held-out images carved by another draw are other images, and so are the
    training images: the epoch's order would skip and repeat other ones."""
    if held_out_carve is None:
        return  # nothing carved: the data's own splits (other data is refused by its counts)
    before = previous.held_out_carve or "random"  # before --val-stratify, every carve was
    if before != held_out_carve:
        drawn = {"random": "by one random draw", "stratified": "class by class"}
        raise RunDiffers(f"the checkpoint's run carved its validation images "
                         f"{drawn[before]}, this start {drawn[held_out_carve]}: they are other "
                         f"images; resume "
                         f"{'with' if before == 'stratified' else 'without'} --val-stratify, "
                         f"or start a new run")


def read_state(directory: Path) -> TrainerState:
    return TrainerState.from_json(read_json(directory / STATE_FILE, "trainer_state"))
