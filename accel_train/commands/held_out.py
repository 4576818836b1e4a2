"""What `export` measures on the run's own held-out images: the ONNX check's batch and the
model card's top-1/top-5 with and without test-time augmentation.  The images are rebuilt from
the run's config.yaml exactly as `accel-train eval` rebuilds them (eval.data_config), and
prepared as training prepared its held-out images."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from accel_train.base.errors import UsageError
from accel_train.data.transforms import held_out_transform


@dataclass
class HeldOut:
    dataset: Optional[object]  # HeldOutImages, or None when the run's data cannot be had
    description: str           # the data, or why there is none
    metrics: dict = field(default_factory=dict)  # tta -> {"top1", "top5", "count"}

    def first_images(self, count: int) -> Optional[torch.Tensor]:
        if self.dataset is None:
            return None
        return torch.stack([self.dataset[i][0] for i in range(min(count, len(self.dataset)))])


def run_held_out(trained) -> HeldOut:
    """The held-out split of the run that `trained` comes from; an export folder has no run,
    and a run whose data moved has none here: then `dataset` is None and `description` says
    why (export goes on without the numbers that need it)."""
    from accel_train.data.loaders import HeldOutImages
    from accel_train.data.sources import load_data
    from accel_train.data.streaming import load_streaming, streaming_wanted
    from accel_train.commands.eval import align_labels, build_parser, data_config

    if trained.run_dir is None:
        return HeldOut(None, f"{trained.description} has no run directory with its data")
    # eval's own parser with no options given: the run's own data, whatever options eval has
    no_other_data = build_parser().parse_args([str(trained.run_dir)])
    try:
        config = data_config(trained, no_other_data)
        data = load_streaming(config) if streaming_wanted(config) else load_data(config)
    except UsageError as err:
        # eval's words without eval's remedy: export takes no --data-dir or --dataset
        reason = str(err).split("; pass --data-dir")[0]
        return HeldOut(None, f"the run's data is not reachable here ({reason})")
    align_labels(data.held_out, data.class_names, trained.spec.class_names, data.description)
    spec = trained.spec
    transform = held_out_transform(spec)
    if len(data.held_out) == 0:
        return HeldOut(None, f"the held-out split of {data.description} is empty")
    return HeldOut(HeldOutImages(data.held_out, transform, mark_replaced=True),
                   f"{len(data.held_out)} held-out images of {data.description}")


def measure(held_out: HeldOut, model, num_classes: int, batch_size: int = 64,
            run_tta: str = "none") -> None:
    """Top-1/top-5 of `model` (float32, this machine's device) with and without flip TTA, and
    with the run's own TTA when it is another, through the evaluation the trainer and `eval`
    use."""
    from accelerate import Accelerator

    from accel_train.data.loaders import make_loader
    from accel_train.train.evaluate import evaluate_classifier

    if held_out.dataset is None:
        return
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision="no")
    loader = accelerator.prepare(make_loader(held_out.dataset, batch_size, 0, 2, False, False))
    device_model = model.to(accelerator.device)
    for tta in dict.fromkeys(("none", "flip", run_tta)):
        results = evaluate_classifier(accelerator, device_model, loader, num_classes,
                                      channels_last=False, tta=tta)
        held_out.metrics[tta] = {k: results[k] for k in ("top1", "top5", "count")}
    model.to("cpu")
