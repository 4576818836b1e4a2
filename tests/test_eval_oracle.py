"""`accel-train eval --json` against an independent evaluation: the exported weights loaded with
timm + safetensors directly, the held-out images rebuilt from the raw generator, normalization,
forward pass, cross-entropy, top-1/top-5 and per-class counts in plain torch."""

from __future__ import annotations

import json

import pytest
import timm
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from accel_train import synthetic

from conftest import accel_train_here, TINY_TRAIN

TRAIN_SIZE = 256  # as in TINY_TRAIN
EVAL_SAMPLES = 64


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval_oracle") / "run"
    args = list(TINY_TRAIN)
    assert args[args.index("--synthetic-train-size") + 1] == str(TRAIN_SIZE)
    assert args[args.index("--max-eval-samples") + 1] == str(EVAL_SAMPLES)
    accel_train_here(*args, "--max-steps", "12", "--lr", "0.2", "--output-dir", str(out),
                     check=True)
    return out


def _eval_json(*args: str) -> dict:
    result = accel_train_here("eval", *args, "--json", check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def _oracle(run_dir, images_nhwc, labels, mirrored_too: bool = False) -> dict:
    """Plain-torch evaluation of the exported model on uint8 NHWC images; `mirrored_too`: the
    logits averaged with those of the images flipped left-right (numpy's flip of the width)."""
    spec = json.loads((run_dir / "model_config.json").read_text())
    model = timm.create_model(spec["model_name"], num_classes=spec["num_classes"])
    model.load_state_dict(load_file(str(run_dir / "model.safetensors")))  # strict: every key
    model.eval()
    x = torch.from_numpy(images_nhwc).permute(0, 3, 1, 2).to(torch.float64) / 255.0
    mean = torch.tensor(spec["mean"], dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor(spec["std"], dtype=torch.float64).view(1, 3, 1, 1)
    x = ((x - mean) / std).float()
    assert x.shape[-1] == spec["image_size"]  # synthetic images are already at the model's size
    y = torch.from_numpy(labels)
    with torch.no_grad():
        logits = model(x).double()
        if mirrored_too:
            mirrored = torch.from_numpy(images_nhwc[:, :, ::-1].copy()).permute(0, 3, 1, 2)
            mirrored = ((mirrored.to(torch.float64) / 255.0 - mean) / std).float()
            logits = (logits + model(mirrored).double()) / 2
    log_probs = logits - logits.logsumexp(dim=1, keepdim=True)
    loss = float(-log_probs[torch.arange(len(y)), y].mean())
    ranks = (logits > logits.gather(1, y[:, None])).sum(dim=1)  # classes scored above the truth
    top1, top5 = ranks == 0, ranks < 5
    with torch.no_grad():
        loss_if_train_mode = float(F.cross_entropy(model.train()(x), y))
    names = spec["class_names"]
    per_class = {name: {"correct": int((top1 & (y == c)).sum()), "images": int((y == c).sum())}
                 for c, name in enumerate(names)}
    return {"loss": loss, "top1_correct": int(top1.sum()), "top5_correct": int(top5.sum()),
            "count": len(y), "per_class": per_class,
            "loss_if_train_mode": loss_if_train_mode}


def _check(report: dict, oracle: dict):
    assert report["count"] == oracle["count"]
    assert report["loss"] == pytest.approx(oracle["loss"], abs=1e-4)
    assert round(report["top1"] * report["count"]) == oracle["top1_correct"]
    assert round(report["top5"] * report["count"]) == oracle["top5_correct"]
    assert report["top1"] == pytest.approx(oracle["top1_correct"] / oracle["count"], abs=1e-6)
    assert report["top5"] == pytest.approx(oracle["top5_correct"] / oracle["count"], abs=1e-6)
    got = {name: {"correct": v["correct"], "images": v["images"]}
           for name, v in report["per_class"].items()}
    assert got == oracle["per_class"]
    # The oracle can tell a wrong evaluation apart (BatchNorm in train mode, say).
    assert abs(oracle["loss_if_train_mode"] - oracle["loss"]) > 1e-3


def test_eval_held_out_matches_a_plain_torch_evaluation(run_dir):
    report = _eval_json(str(run_dir))
    images, labels = synthetic.splits(TRAIN_SIZE)["test"]
    oracle = _oracle(run_dir, images[:EVAL_SAMPLES], labels[:EVAL_SAMPLES])
    assert report["split"] == "held-out"
    _check(report, oracle)
    # a trained model, not chance: the comparison is not between two trivial answers
    assert oracle["top1_correct"] > EVAL_SAMPLES * 0.15 and oracle["top5_correct"] < EVAL_SAMPLES


def test_eval_train_split_with_a_ragged_last_batch(run_dir):
    # 40 images in batches of 7: the last batch holds 5; each image must count exactly once.
    report = _eval_json(str(run_dir), "--split", "train", "--max-samples", "40",
                        "--batch-size", "7")
    images, labels = synthetic.splits(TRAIN_SIZE)["train"]
    assert report["split"] == "train"
    _check(report, _oracle(run_dir, images[:40], labels[:40]))


def test_eval_with_flip_tta_matches_a_plain_torch_evaluation_of_both_views(run_dir):
    images, labels = synthetic.splits(TRAIN_SIZE)["test"]
    images, labels = images[:EVAL_SAMPLES], labels[:EVAL_SAMPLES]
    report = _eval_json(str(run_dir), "--tta", "flip")
    assert report["tta"] == "flip"
    _check(report, _oracle(run_dir, images, labels, mirrored_too=True))
    plain = _oracle(run_dir, images, labels)
    assert abs(plain["loss"] - report["loss"]) > 1e-4, "the mirrored views changed nothing"
