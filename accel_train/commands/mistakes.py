"""`accel-train eval RUN --mistakes FILE`: the evaluated images the model got wrong, as a CSV,
the ones least likely under their own label first.  Those are where a folder's mislabelled
images gather (cleanlab ranks label issues by this "self-confidence"; fastai's top losses are
the same order, the loss being -log of it), and the rest say which classes look alike.

  image,class,predicted,probability,class_probability
  train/ring/0042.png,ring,disk,0.913201,0.004113

`image` names the file as training's own messages do (its path inside --data-dir for a
folder; a parquet file and row, or a split and row), `probability` is the predicted class's.
Written beside its name and renamed onto it (csv_files.CsvOutput), by the main process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

from accel_train.commands.csv_files import CsvOutput

HEADER = ("image", "class", "predicted", "probability", "class_probability")


def mistake_rows(samples: dict, class_names: Sequence[str],
                 image_name: Callable[[int], str]) -> list[list[str]]:
    """The wrong samples of evaluate_classifier's "samples" as CSV rows, the lowest
    probability of the own label first (the data's order among equals)."""
    wrong = (samples["predicted"] != samples["labels"]).nonzero()[:, 0].tolist()
    keys, labels = samples["keys"].tolist(), samples["labels"].tolist()
    predicted = samples["predicted"].tolist()
    probability = samples["probability"].tolist()
    own = samples["label_probability"].tolist()
    wrong.sort(key=lambda i: (own[i], keys[i]))
    return [[image_name(keys[i]), class_names[labels[i]], class_names[predicted[i]],
             f"{probability[i]:.6f}", f"{own[i]:.6f}"] for i in wrong]


def image_namer(sources: Sequence, first_keys: Sequence[int], split_names: Sequence[str]
                ) -> Callable[[int], str]:
    """key -> the image's name: the source whose keys begin at or below it, and that source's
    own name for it (decoded-on-demand sources name their files and rows); images held as
    arrays (the synthetic set) have no file: `held-out image 17`."""
    def name(key: int) -> str:
        part = max(k for k, first in enumerate(first_keys) if first <= key)
        index = key - first_keys[part]
        named = getattr(sources[part], "name", None)
        return named(index) if named is not None else f"{split_names[part]} image {index}"
    return name


def write_mistakes(path: Path, rows: Sequence[Sequence[str]]) -> None:
    with CsvOutput(path, HEADER, flag="--mistakes") as out:
        for row in rows:
            out.write(row)
        out.commit()
