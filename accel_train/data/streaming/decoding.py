"""Decoding a batch of read samples into image tensors, under the --bad-images policy.

The substitute for a bad sample is chosen within its batch only, so the choice is a function of
the batch: a resumed run replaces the same samples with the same substitutes.
"""

from __future__ import annotations

from typing import Optional

from accel_train.base.errors import UsageError
from accel_train.data.decode import decode_many, Unreadable


def label_problem(label, num_classes: Optional[int]) -> Optional[str]:
    """Why a sample's label cannot train (None: it can): none at all, or none of the
    `num_classes` classes (the network has no output for it: the loss would fail mid-run)."""
    if label is None:
        return "no label (.cls)"
    if num_classes is not None and not 0 <= int(label) < num_classes:
        return f"label {label} is not one of the {num_classes} classes (0 to {num_classes - 1})"
    return None


def sample_problem(decoded, label, num_classes: Optional[int]) -> Optional[str]:
    """Why a sample cannot train (None: it can): `decoded`, decode_many's result for its image,
    says the image does not decode, else its label's problem (label_problem)."""
    if isinstance(decoded, Unreadable):
        return decoded.reason
    return label_problem(label, num_classes)


def decode_substituting(samples: list[tuple], policy: str, num_classes: Optional[int] = None):
    """(images, labels, [(position, reason)] of the samples replaced): under --bad-images
    substitute, a sample whose image cannot be decoded (or whose label is missing or none of
    the `num_classes` classes) takes the image and label of the next good sample of the same
    batch (a function of the batch alone, so a resumed run replaces it the same way); under
    error, the first one stops the run, named."""
    images = decode_many([image if image is not None else b"" for image, _, _ in samples])
    bad = []
    for position, (result, (_, label, name)) in enumerate(zip(images, samples)):
        reason = sample_problem(result, label, num_classes)
        if reason is None:
            continue
        if policy == "error":
            raise UsageError(f"sample {name} cannot be used ({reason}); remove or replace it, or "
                             f"pass --bad-images substitute to train on with a substitute")
        bad.append((position, reason))
    broken = {position for position, _ in bad}
    if len(broken) == len(samples):
        raise UsageError(f"no sample of a batch can be decoded (the first: {samples[0][2]}: "
                         f"{bad[0][1]}); check the shards")
    labels = [None if position in broken else int(label)
              for position, (_, label, _) in enumerate(samples)]
    for position, _ in bad:
        used = next((position + step) % len(samples) for step in range(1, len(samples))
                    if (position + step) % len(samples) not in broken)
        images[position], labels[position] = images[used], labels[used]
    return images, labels, bad
