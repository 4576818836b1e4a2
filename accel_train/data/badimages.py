"""Broken images met by a training run: each named once for all ranks, listed, counted.

Where they are met: images decoded in memory are replaced while loading (`LoadedData.
bad_images`, the same list on every rank); images decoded per step are replaced wherever they
are met, in any rank's loader worker processes.  Those batches carry back the index of each
replaced sample (data.replaced_marks), and the training process re-checks that one image (a
single decode, once per image and rank) to name it and say why.  At every log window, epoch end
and stop, every rank hands what it found to rank 0 (one small all_gather_object), which says
each new image once, appends it to <run>/bad_images.txt (`name<TAB>reason` lines) and counts
them: `bad_images` in metrics.jsonl's epoch records and a line in the final summary.  The marks
are looked at only then, too: reading them per step would make the host wait for the GPU.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from accel_train.base.errors import first_few
from accel_train.base.ranks import more_than_one_rank
from accel_train.base.readers import read_json
from accel_train.data.labels import unreadable_classes_named
from accel_train.data.sources import BadImage, LoadedData

BAD_IMAGES_FILE = "bad_images.json"  # in each checkpoint: name -> reason
MAX_SAID = 100  # warnings printed per start; the others go to the log and bad_images.txt only


class BadImageLog:
    """One per rank; `collect` is a collective (every rank calls it at the same points)."""

    def __init__(self, path: Path, report, data: LoadedData, is_main: bool):
        self.path, self.report, self.is_main = Path(path), report, is_main
        self.sources = {"train": data.train, "held-out": data.held_out,
                        **({"test": data.test} if data.test is not None else {})}
        for source in self.sources.values():
            if hasattr(source, "on_substitute"):
                source.on_substitute = None  # this log names them, once for all processes
        self.pending: list[BadImage] = list(data.bad_images)
        self.marks: list[tuple[str, torch.Tensor]] = []  # batches' marks not looked at yet
        self.checked: set[tuple[str, int]] = set()  # (split, index) met by this rank
        self.named: dict[str, str] = {}  # name -> reason, on the main process
        self.said = 0
        # Training images decoded per step are met as the epoch goes: a class none of whose
        # images decodes is found once an epoch has met them all (decoded into memory, the
        # run refuses it before training: sources.refuse_classes_left_unreadable).
        self.class_names = data.class_names
        self.broken_train: set[int] = set()  # their indices, as named in this start
        self.lost_classes = ""  # said once
        # Streamed shards have no labels before they are read: their classes are counted as
        # an epoch meets them instead (StreamCounts).
        self.stream = StreamCounts(len(data.class_names)) if not len(data.train.labels) \
            and len(data.train) else None

    # -- a checkpointed part (checkpoint.py): a resumed run knows what was named before ----------
    name = "bad_images"

    def save(self, folder: Path) -> None:
        (Path(folder) / BAD_IMAGES_FILE).write_text(json.dumps(self.named, indent=1) + "\n")

    def load(self, folder: Path) -> None:
        """The images named up to the checkpoint; <run>/bad_images.txt is rewritten to match
        (what a redone future had named is named again when met again)."""
        if not self.is_main:
            return
        self.named = read_json(Path(folder) / BAD_IMAGES_FILE, "bad_images")  # name -> why
        if self.named or self.path.is_file():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("".join(f"{name}\t{reason}\n"
                                         for name, reason in self.named.items()))

    @property
    def count(self) -> int:
        """Broken images named so far in this run (main process; 0 elsewhere)."""
        return len(self.named)

    def note(self, split: str, replaced: torch.Tensor,
             labels: Optional[torch.Tensor] = None) -> None:
        """A batch's marks (data.replaced_marks), looked at in `collect`; a streamed training
        batch's `labels` are counted too."""
        self.marks.append((split, replaced))
        if self.stream is not None and split == "train" and labels is not None:
            self.stream.add(labels, replaced)

    def strip(self, batches: Iterable, split: str = "held-out"):
        """Marked held-out batches as they come (evaluate_classifier leaves the marked images
        out of its numbers), noting the marks on the way."""
        for images, labels, replaced in batches:
            self.note(split, replaced)
            yield images, labels, replaced

    def _check_marks(self) -> None:
        """Re-check the images the marks say were replaced (each once on this rank)."""
        marks, self.marks = self.marks, []
        for split, replaced in marks:
            if not hasattr(self.sources[split], "bad_image"):
                continue  # decoded into memory: met, and named, while loading
            for index in replaced[replaced >= 0].tolist():
                if (split, index) in self.checked:
                    continue
                self.checked.add((split, index))
                bad = self.sources[split].bad_image(index)
                if bad is not None:
                    self.pending.append(bad)

    def collect(self) -> int:
        """Every rank together: rank 0 names, lists and counts what any rank found since the
        last call.  Returns the count (on the main process)."""
        self._check_marks()
        found, self.pending = self.pending, []
        counted = self.stream.take() if self.stream is not None else None
        if more_than_one_rank():
            parts: list[Optional[tuple]] = [None] * dist.get_world_size()
            dist.all_gather_object(parts, (found, counted))
            found = [bad for part, _ in parts for bad in part]
            counts = [count for _, count in parts]
        else:
            counts = [counted]
        if self.is_main:
            for bad in found:
                self._name(bad)
            if self.stream is not None:
                self.stream.merge(counts)
        return self.count

    def _name(self, bad: BadImage) -> None:
        if bad.split == "train":
            self.broken_train.add(bad.index)
            if self.stream is not None and bad.label is not None:
                self.stream.broken[bad.index] = bad.label
        if bad.name in self.named:
            return
        self.named[bad.name] = bad.reason
        with self.path.open("a") as handle:
            handle.write(f"{bad.name}\t{bad.reason}\n")
        what = ("a substitute (the next image that decodes) takes its place" if bad.split ==
                "train" else "left out of the evaluation's numbers")
        text = (f"{'' if bad.split == 'train' else bad.split + ' '}image {bad.name} cannot be "
                f"decoded ({bad.reason}); {what}")
        self.said += 1
        if self.said <= MAX_SAID:
            self.report.warn(text)
        else:
            self.report.log(text)
        if self.said == MAX_SAID:
            self.report.warn(f"more broken images are listed in {self.path} only")

    def after_epoch(self) -> None:
        """At an epoch's end (main process, after `collect`): a class every training image of
        which has been met and could not be decoded trains its output on substitutes of other
        classes; said once, and in the final summary.  Only images met count (an epoch's
        remainder may be left for the next, and a start resumed mid-epoch knows only what it
        met itself): such a class may be said an epoch later, never one wrongly."""
        if self.stream is not None:  # (always: its epoch's counts start again)
            lost = first_few(f"{self.class_names[c]!r} ({count} images)"
                             for c, count in self.stream.lost_in_epoch(len(self.sources["train"])))
        elif self.broken_train and not self.lost_classes:
            lost = unreadable_classes_named(self.sources["train"].labels, self.broken_train,
                                            self.class_names)
        else:
            return
        if lost and not self.lost_classes:
            self.lost_classes = lost
            self.report.warn(f"no training image of class {self.lost_classes} decodes (each "
                             f"was met and replaced): the run trains those outputs on "
                             f"substitutes of other classes, and its numbers for them mean "
                             f"nothing; fix or replace the files (listed in {self.path}), or "
                             f"remove the class, and start again")

    def summary(self) -> Optional[str]:
        if not self.count:
            return None
        return (f"{self.count} broken image(s) replaced by substitutes in training and left "
                f"out of the evaluations, listed in {self.path}"
                + (f" (no training image of class {self.lost_classes} decoded)"
                   if self.lost_classes else "")
                + "; accel-train check-data --data-dir DIR checks a folder before training")


class StreamCounts:
    """A streamed run's classes, counted as its epochs meet them: per class, the training
    samples that decoded (a replaced one carries its substitute's label, so it counts for
    none), and the samples met at all.  Counted on the device where the labels are (no host
    wait per step), handed to the main process at each `collect`.  A class is lost when an
    epoch met every training sample and none of its own decoded, but some of its samples were
    met broken: an epoch that met fewer (a start resumed inside it, samples left out to keep
    the ranks in step) decides nothing, so a class is never named wrongly."""

    def __init__(self, num_classes: int):
        self.num_classes = num_classes
        self.good: Optional[torch.Tensor] = None  # this rank, since the last take
        self.met = 0
        self.epoch_good = [0] * num_classes  # main process: all ranks, this epoch
        self.epoch_met = 0
        self.broken: dict[int, int] = {}  # main process: index -> class of a broken sample

    def add(self, labels: torch.Tensor, replaced: torch.Tensor) -> None:
        # a comparison with every class and a sum: no host wait (bincount and one_hot read
        # the labels' range on the host) and no atomics (index_add_ on CUDA)
        classes = torch.arange(self.num_classes, device=labels.device)
        decoded = ((labels[:, None] == classes) & (replaced[:, None] < 0)).sum(dim=0)
        self.good = decoded if self.good is None else self.good + decoded
        self.met += len(labels)

    def take(self) -> tuple[int, list[int]]:
        """(samples met, decoded per class) on this rank since the last take, and reset."""
        good = self.good.tolist() if self.good is not None else [0] * self.num_classes
        met, self.good, self.met = self.met, None, 0
        return met, good

    def merge(self, counts: list[tuple[int, list[int]]]) -> None:
        for met, good in counts:
            self.epoch_met += met
            self.epoch_good = [a + b for a, b in zip(self.epoch_good, good)]

    def lost_in_epoch(self, samples: int) -> list[tuple[int, int]]:
        """[(class, its broken samples)] lost in the epoch just ended (`samples`: the training
        split's); the epoch's counts start again."""
        whole = self.epoch_met >= samples
        good, self.epoch_good, self.epoch_met = self.epoch_good, [0] * self.num_classes, 0
        if not whole:
            return []
        broken = torch.bincount(torch.tensor(list(self.broken.values()), dtype=torch.long),
                                minlength=self.num_classes).tolist()
        return [(c, broken[c]) for c in range(self.num_classes) if broken[c] and not good[c]]
