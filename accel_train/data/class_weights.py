"""`--class-weight balanced`: each class's cross-entropy weighted by how rare it is in the
training split, scikit-learn's `class_weight="balanced"` (n_images / (n_classes x the class's
images)): on a folder of 45 cats and 5 dogs a dog's loss counts 9 times a cat's, so the two
classes weigh alike in every epoch.  Only the training loss: the held-out loss stays the plain
mean over images, comparable with runs without it.
"""

from __future__ import annotations

from typing import Optional

import torch

from accel_train.base.errors import UsageError


def balanced_weights(labels: torch.Tensor, class_names: list[str]) -> torch.Tensor:
    """float32 weights, one a class: len(labels) / (classes x the class's count).  A class
    without a training image has no count to weigh by: refused, naming it."""
    counts = torch.bincount(labels.long(), minlength=len(class_names))
    empty = [class_names[i] for i in torch.nonzero(counts == 0).flatten().tolist()]
    if empty:
        shown = ", ".join(empty[:5]) + (f" and {len(empty) - 5} more" if len(empty) > 5 else "")
        raise UsageError(f"--class-weight balanced: class(es) {shown} have no training images "
                         f"to weigh by; give them images (or a larger --max-train-samples), "
                         f"or drop the flag")
    return (len(labels) / (len(class_names) * counts.double())).float()


def maybe_class_weights(choice: str, train, class_names: list[str]) -> Optional[torch.Tensor]:
    """The training split's balanced weights, or None for --class-weight none."""
    if choice == "none":
        return None
    if len(train.labels) != len(train):  # streamed shards: their labels come as they stream
        raise UsageError("--class-weight balanced counts each class's training images before "
                         "training, which streamed shards do not tell; drop the flag, or "
                         "train from the image folder or parquet files")
    return balanced_weights(train.labels, class_names)


def describe_weights(weights: torch.Tensor, class_names: list[str]) -> str:
    """'x0.556 (cat) to x5 (dog)': the lightest and the heaviest class, for the summary."""
    low, high = int(weights.argmin()), int(weights.argmax())
    return (f"each class's loss weighted by its rarity, x{weights[low]:.3g} ({class_names[low]}) "
            f"to x{weights[high]:.3g} ({class_names[high]}) (--class-weight balanced)")
