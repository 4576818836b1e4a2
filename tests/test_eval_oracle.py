"""`accel-train eval --json` against an independent evaluation: the exported weights loaded with
timm + safetensors directly, the held-out images rebuilt from the raw generator, normalization,
forward pass, cross-entropy, top-1/top-5 and per-class counts in plain torch."""

from __future__ import annotations

import json

import pytest
import timm
import torch
import torch.nn.functional as F
import torchvision.transforms.functional as TF
from safetensors.torch import load_file

from accel_train.data import synthetic

from conftest import accel_train_here, drawn_subset, model_spec_of, TINY_TRAIN

TRAIN_SIZE = 256  # as in TINY_TRAIN
EVAL_SAMPLES = 64


def _drawn(split: str, count: int):
    """`count` images of the synthetic set's `split` ("train", or "test": the runs' held-out
    split) and their labels, as a limit keeps them by default (--sample-subset random)."""
    images, labels = synthetic.splits(TRAIN_SIZE)[split]
    kept = drawn_subset(len(labels), count)
    return images[kept], labels[kept]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval_oracle") / "run"
    args = list(TINY_TRAIN)
    assert args[args.index("--synthetic-train-size") + 1] == str(TRAIN_SIZE)
    assert args[args.index("--max-eval-samples") + 1] == str(EVAL_SAMPLES)
    accel_train_here(*args, "--max-steps", "12", "--lr", "0.2", "--output-dir", str(out),
                     check=True)
    return out


@pytest.fixture(scope="module")
def flip_run_dir(tmp_path_factory):
    """The same run trained with --tta flip: eval, predict and export of it mirror by default."""
    out = tmp_path_factory.mktemp("eval_oracle_flip") / "run"
    accel_train_here(*TINY_TRAIN, "--max-steps", "12", "--lr", "0.2", "--tta", "flip",
                     "--output-dir", str(out), check=True)
    return out


def _eval_json(*args: str) -> dict:
    result = accel_train_here("eval", *args, "--json", check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


class _Float32ByHand(torch.nn.Module):
    """A convolution computed by plain F.conv2d in float32 whatever autocast says, its output
    handed on in autocast's dtype (as the layers after it compute)."""

    def __init__(self, conv: torch.nn.Conv2d):
        super().__init__()
        self.conv = conv

    def forward(self, x):
        handed_on = torch.bfloat16 if torch.is_autocast_enabled("cpu") else torch.float32
        with torch.autocast("cpu", enabled=False):
            conv = self.conv
            out = F.conv2d(x.float(), conv.weight, conv.bias, conv.stride, conv.padding)
        return out.to(handed_on)


def _plain_logits(run_dir, images_nhwc, mirrored_too: bool = False,
                  float32_stem: bool = False, float32_normalization: bool = False
                  ) -> torch.Tensor:
    """The exported model in plain timm + torch on uint8 NHWC images (float64 normalization, or
    `float32_normalization`: torchvision's to_tensor and normalize, in float32);
    `mirrored_too`: averaged with the logits of the images flipped left-right by numpy;
    `float32_stem`: test_resnet's first convolution computed in float32 (_Float32ByHand)."""
    spec = model_spec_of(run_dir)
    model = timm.create_model(spec["model_name"], num_classes=spec["num_classes"])
    model.load_state_dict(load_file(str(run_dir / "model.safetensors")))
    model.eval()
    if float32_stem:
        model.conv1[0] = _Float32ByHand(model.conv1[0])
    mean = torch.tensor(spec["mean"], dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor(spec["std"], dtype=torch.float64).view(1, 3, 1, 1)

    def normalized(array):
        if float32_normalization:
            return torch.stack([TF.normalize(TF.to_tensor(image.copy()), spec["mean"], spec["std"])
                                for image in array])
        x = torch.from_numpy(array.copy()).permute(0, 3, 1, 2).to(torch.float64) / 255.0
        return ((x - mean) / std).float()

    with torch.no_grad():
        logits = model(normalized(images_nhwc)).double()
        if mirrored_too:
            logits = (logits + model(normalized(images_nhwc[:, :, ::-1])).double()) / 2
    return logits


def _oracle(run_dir, images_nhwc, labels, mirrored_too: bool = False) -> dict:
    """Plain-torch evaluation of the exported model on uint8 NHWC images; `mirrored_too`: the
    logits averaged with those of the images flipped left-right (numpy's flip of the width)."""
    spec = model_spec_of(run_dir)
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
    guess = logits.argmax(dim=1)
    per_class = {name: {"correct": int((top1 & (y == c)).sum()), "images": int((y == c).sum()),
                        "predicted": int((guess == c).sum()),
                        "mistaken_for": _most_common_mistake(guess[(y == c) & (guess != c)],
                                                             names)}
                 for c, name in enumerate(names)}
    present = [c for c in range(len(names)) if (y == c).any()]
    mean_class_top1 = float(torch.stack([top1[y == c].double().mean() for c in present]).mean())
    return {"loss": loss, "mean_class_top1": mean_class_top1,
            "top1_correct": int(top1.sum()), "top5_correct": int(top5.sum()),
            "count": len(y), "per_class": per_class,
            "loss_if_train_mode": loss_if_train_mode}


def _most_common_mistake(guesses: torch.Tensor, names: list[str]):
    """The class these wrong guesses name most often (the first in class order among equals),
    counted with collections.Counter; None where there are none."""
    import collections
    counts = collections.Counter(guesses.tolist())
    if not counts:
        return None
    most = max(counts.values())
    first = min(c for c, n in counts.items() if n == most)
    return {"class": names[first], "images": most}


def _check(report: dict, oracle: dict):
    assert report["count"] == oracle["count"]
    assert report["loss"] == pytest.approx(oracle["loss"], abs=1e-4)
    assert round(report["top1"] * report["count"]) == oracle["top1_correct"]
    assert round(report["top5"] * report["count"]) == oracle["top5_correct"]
    assert report["top1"] == pytest.approx(oracle["top1_correct"] / oracle["count"], abs=1e-6)
    assert report["top5"] == pytest.approx(oracle["top5_correct"] / oracle["count"], abs=1e-6)
    got = {name: {key: v[key] for key in ("correct", "images", "predicted", "mistaken_for")}
           for name, v in report["per_class"].items()}
    assert got == oracle["per_class"]
    for v in report["per_class"].values():  # precision: right among those predicted as it
        assert v["precision"] == (v["correct"] / v["predicted"] if v["predicted"] else None)
    assert report["mean_class_top1"] == pytest.approx(oracle["mean_class_top1"], abs=1e-9)
    # The oracle can tell a wrong evaluation apart (BatchNorm in train mode, say).
    assert abs(oracle["loss_if_train_mode"] - oracle["loss"]) > 1e-3


def test_eval_held_out_matches_a_plain_torch_evaluation(run_dir):
    report = _eval_json(str(run_dir))
    oracle = _oracle(run_dir, *_drawn("test", EVAL_SAMPLES))
    assert report["split"] == "held-out"
    _check(report, oracle)
    # a trained model, not chance: the comparison is not between two trivial answers
    assert oracle["top1_correct"] > EVAL_SAMPLES * 0.15 and oracle["top5_correct"] < EVAL_SAMPLES


def test_eval_train_split_with_a_ragged_last_batch(run_dir):
    # 40 images in batches of 7: the last batch holds 5; each image must count exactly once.
    report = _eval_json(str(run_dir), "--split", "train", "--max-samples", "40",
                        "--batch-size", "7")
    assert report["split"] == "train"
    _check(report, _oracle(run_dir, *_drawn("train", 40)))
    # training's name for the limit, carried over from the run's command: the same images
    _check(_eval_json(str(run_dir), "--split", "train", "--max-eval-samples", "40"),
           _oracle(run_dir, *_drawn("train", 40)))


def test_eval_of_images_without_the_last_class_still_counts_every_class(run_dir):
    """The held-out split's first images hold no image of the last class (nor of class 0): the
    per-class counts still name all ten, those with zero images (a count sized by the labels
    seen would drop the last)."""
    images, labels = synthetic.splits(TRAIN_SIZE)["test"]
    count = next(n for n in range(len(labels)) if labels[n] == labels.max())
    assert count >= 5 and labels.max() == 9 and 0 not in labels[:count]
    report = _eval_json(str(run_dir), "--max-samples", str(count), "--sample-subset", "first")
    assert len(report["per_class"]) == 10
    _check(report, _oracle(run_dir, images[:count], labels[:count]))
    # without --max-samples the rule would silently rebuild other held-out images: refused
    alone = accel_train_here("eval", str(run_dir), "--sample-subset", "first")
    assert alone.returncode == 2 and alone.stderr.strip().splitlines() == [
        "accel_train: error: --sample-subset chooses which images --max-samples keeps; give "
        "--max-samples N too (without it, eval rebuilds the run's own held-out images by the "
        "run's own rule)"], alone.stderr


def test_eval_of_a_run_from_before_the_subset_rule_rebuilds_its_first_images(run_dir, tmp_path):
    """A run whose config.yaml has no sample_subset (written when --max-eval-samples kept the
    first N): eval rebuilds the held-out images that run evaluated, the first 64, not a draw."""
    import shutil

    import yaml
    old = tmp_path / "old_run"
    shutil.copytree(run_dir, old)
    config = yaml.safe_load((old / "config.yaml").read_text())
    assert config["train"].pop("sample_subset") == "random"
    (old / "config.yaml").write_text(yaml.safe_dump(config))
    images, labels = synthetic.splits(TRAIN_SIZE)["test"]
    _check(_eval_json(str(old)), _oracle(old, images[:EVAL_SAMPLES], labels[:EVAL_SAMPLES]))


def test_eval_with_flip_tta_matches_a_plain_torch_evaluation_of_both_views(run_dir):
    images, labels = _drawn("test", EVAL_SAMPLES)
    report = _eval_json(str(run_dir), "--tta", "flip")
    assert report["tta"] == "flip"
    _check(report, _oracle(run_dir, images, labels, mirrored_too=True))
    plain = _oracle(run_dir, images, labels)
    assert abs(plain["loss"] - report["loss"]) > 1e-4, "the mirrored views changed nothing"


def test_eval_of_a_named_dataset_matches_plain_torch(run_dir):
    """--dataset synthetic names the data to evaluate on (the test split does not depend on the
    training size): 48 of it (drawn as --sample-subset random draws them), against plain torch."""
    report = _eval_json(str(run_dir), "--dataset", "synthetic", "--max-samples", "48")
    _check(report, _oracle(run_dir, *_drawn("test", 48)))


def test_eval_loader_flags_reach_its_loader(run_dir, monkeypatch):
    """A probe on torch's DataLoader (outside the package) sees --batch-size and --num-workers;
    the numbers are still the oracle's."""
    seen = []
    original = torch.utils.data.DataLoader.__init__

    def probe(self, *args, **kwargs):
        original(self, *args, **kwargs)
        seen.append((self.batch_size, self.num_workers))

    monkeypatch.setattr(torch.utils.data.DataLoader, "__init__", probe)
    report = _eval_json(str(run_dir), "--split", "train", "--max-samples", "20",
                        "--batch-size", "7", "--num-workers", "1")
    # (Accelerate's prepared loader is rebuilt around the first one's batch sampler)
    assert seen and seen[0] == (7, 1) and all(workers == 1 for _, workers in seen), seen
    _check(report, _oracle(run_dir, *_drawn("train", 20)))


def test_eval_in_bf16_is_near_but_not_the_fp32_oracle(run_dir):
    oracle = _oracle(run_dir, *_drawn("test", EVAL_SAMPLES))
    fp32 = _eval_json(str(run_dir), "--mixed-precision", "no")
    _check(fp32, oracle)
    bf16 = _eval_json(str(run_dir), "--mixed-precision", "bf16")
    assert bf16["loss"] == pytest.approx(oracle["loss"], abs=0.05)
    assert abs(bf16["loss"] - oracle["loss"]) > 1e-6, "bf16 asked for, fp32 ran"


def _predictions(*args: str) -> list[dict]:
    result = accel_train_here("predict", *args, "--json", "--top-k", "10", check=True)
    return [json.loads(line) for line in result.stdout.strip().splitlines()]


def test_predict_is_the_softmax_of_plain_torch_logits(run_dir, flip_run_dir, tmp_path,
                                                      monkeypatch):
    """8 held-out images as PNG files: predict's probabilities are the softmax of the plain-torch
    logits, mirrored too for the run trained with --tta flip (its export as well); --batch-size 3
    gives the same lines from ceil(8/3) batches (a probe on the first convolution counts them)."""
    images, files = _held_out_pngs(tmp_path, 8)

    def expected(run, mirrored):
        probabilities = _plain_logits(run, images, mirrored).softmax(dim=1)
        return probabilities

    def compare(lines, probabilities):
        assert [line["image"] for line in lines] == [str(f) for f in files]
        for line, row in zip(lines, probabilities):
            got = {p["index"]: p["probability"] for p in line["predictions"]}
            assert sorted(got) == list(range(10))
            assert [p["index"] for p in line["predictions"]] == \
                row.argsort(descending=True).tolist()
            for index, value in got.items():
                assert value == pytest.approx(float(row[index]), abs=2e-6)

    batches = []
    monkeypatch.setattr(torch.nn.Conv2d, "forward", _counting(torch.nn.Conv2d.forward, batches))
    plain = _predictions(str(run_dir), *map(str, files), "--batch-size", "3")
    assert batches == [3, 3, 2]
    monkeypatch.undo()
    compare(plain, expected(run_dir, mirrored=False))
    assert _predictions(str(run_dir), *map(str, files)) == plain

    flipped = _predictions(str(flip_run_dir), *map(str, files))
    compare(flipped, expected(flip_run_dir, mirrored=True))
    export = tmp_path / "export"
    accel_train_here("export", str(flip_run_dir), "-o", str(export), check=True)
    assert _predictions(str(export), *map(str, files)) == flipped
    # and eval of the flip run mirrors by default, unless told not to
    held, labels = _drawn("test", EVAL_SAMPLES)
    _check(_eval_json(str(flip_run_dir)), _oracle(flip_run_dir, held, labels, mirrored_too=True))
    _check(_eval_json(str(flip_run_dir), "--tta", "none"), _oracle(flip_run_dir, held, labels))


def _held_out_pngs(folder, count: int):
    """The first `count` held-out images (uint8 NHWC) and the PNG files they were written to."""
    from PIL import Image
    images, _ = synthetic.splits(TRAIN_SIZE)["test"]
    images = images[:count]
    files = [folder / f"{i}.png" for i in range(count)]
    for array, file in zip(images, files):
        Image.fromarray(array).save(file)
    return images, files


def test_the_mistakes_file_is_plain_torchs_wrong_images_least_likely_first(run_dir,
                                                                           tmp_path):
    """eval --mistakes of a class-folder of PNGs against plain torch's softmax of each file:
    every wrong image, its path inside the folder, its label and guess, the guess's and the
    label's probabilities, ordered by the label's; and refusals of the file's place."""
    import pandas as pd
    from PIL import Image
    images, labels = synthetic.splits(TRAIN_SIZE)["test"]
    images, labels = images[:40], labels[:40]
    names = model_spec_of(run_dir)["class_names"]
    folder = tmp_path / "photos"
    files = []
    for index, (array, label) in enumerate(zip(images, labels)):
        files.append(f"{names[label]}/{index:02d}.png")
        (folder / names[label]).mkdir(parents=True, exist_ok=True)
        Image.fromarray(array).save(folder / files[-1])
    out_file = tmp_path / "mistakes.csv"
    result = accel_train_here("eval", str(run_dir), "--data-dir", str(folder), "--split", "all",
                              "--mixed-precision", "no", "--mistakes", str(out_file), check=True)
    probabilities = _plain_logits(run_dir, images).softmax(dim=1)
    guesses = probabilities.argmax(dim=1)
    wrong = [i for i in range(40) if guesses[i] != labels[i]]
    assert 0 < len(wrong) < 40  # the model is right on some, wrong on others
    assert result.stdout.strip().splitlines()[-1] == (
        f"wrote {out_file}: {len(wrong)} wrong image(s) of 40, the least likely under their own "
        f"label first")
    table = pd.read_csv(out_file)
    assert list(table.columns) == ["image", "class", "predicted", "probability",
                                   "class_probability"]
    assert sorted(table["image"]) == sorted(files[i] for i in wrong)
    by_file = {files[i]: i for i in wrong}
    for _, row in table.iterrows():
        i = by_file[row["image"]]
        assert (row["class"], row["predicted"]) == (names[labels[i]], names[guesses[i]])
        assert row["probability"] == pytest.approx(float(probabilities[i, guesses[i]]), abs=1e-5)
        assert row["class_probability"] == pytest.approx(float(probabilities[i, labels[i]]),
                                                         abs=1e-5)
    assert table["class_probability"].is_monotonic_increasing
    # refused before any work, nothing written, the earlier file untouched
    for target, line in ((tmp_path / "nowhere" / "m.csv",
                          f"--mistakes {tmp_path / 'nowhere' / 'm.csv'}: the folder "
                          f"{tmp_path / 'nowhere'} does not exist; create it or name a file in "
                          f"an existing folder"),
                         (folder, f"--mistakes {folder} is a folder; name the file to write "
                                  f"(mistakes.csv)")):
        refused = accel_train_here("eval", str(run_dir), "--mistakes", str(target))
        assert refused.returncode == 2
        assert refused.stderr.strip() == f"accel_train: error: {line}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mistakes.csv", "photos"]


def test_eval_of_every_image_of_a_folder_of_one_image_a_class(run_dir, tmp_path):
    """--split all of other data carves nothing: a folder of one image per class (which a
    training carve refuses: each image would leave its class nothing to train on) is
    evaluated whole, as plain torch evaluates the ten images."""
    from PIL import Image
    images, labels = synthetic.splits(TRAIN_SIZE)["test"]
    names = model_spec_of(run_dir)["class_names"]
    first = [int(next(i for i in range(len(labels)) if labels[i] == c)) for c in range(10)]
    for c, i in enumerate(first):
        (tmp_path / "one" / names[c]).mkdir(parents=True)
        Image.fromarray(images[i]).save(tmp_path / "one" / names[c] / "only.png")
    report = _eval_json(str(run_dir), "--data-dir", str(tmp_path / "one"), "--split", "all",
                        "--mixed-precision", "no")
    assert report["data"] == f"{tmp_path / 'one'} (train, nothing held out)"
    _check(report, _oracle(run_dir, images[first], labels[first]))


def test_mistake_rows_and_image_names_by_hand(tmp_path):
    """The order (the label's probability, then the data's order among equals), the cells,
    the names of files and of images held as arrays, and the refusal of a file that cannot be
    made, all written out by hand."""
    from accel_train.base.errors import UsageError
    from accel_train.commands.mistakes import image_namer, mistake_rows, write_mistakes

    class Files:
        def name(self, index):
            return f"file{index}.png"

    name = image_namer([object(), Files()], [0, 5], ["train", "held-out"])
    assert [name(0), name(4), name(5), name(7)] == ["train image 0", "train image 4",
                                                    "file0.png", "file2.png"]
    samples = {"keys": torch.tensor([3, 1, 2, 0]), "labels": torch.tensor([0, 1, 1, 2]),
               "predicted": torch.tensor([1, 1, 0, 0]),
               "probability": torch.tensor([0.5, 0.9, 0.6, 0.7]),
               "label_probability": torch.tensor([0.2, 0.9, 0.2, 0.1])}
    rows = mistake_rows(samples, ["a", "b", "c"], lambda key: f"k{key}")
    assert rows == [["k0", "c", "a", "0.700000", "0.100000"],
                    ["k2", "b", "a", "0.600000", "0.200000"],
                    ["k3", "a", "b", "0.500000", "0.200000"]]
    too_long = tmp_path / ("m" * 250 + ".csv")  # the hidden partial name is over 255 bytes
    with pytest.raises(UsageError) as caught:
        write_mistakes(too_long, rows)
    assert str(caught.value) == (f"--mistakes {too_long}: cannot write in {tmp_path} (File name "
                                 f"too long); name a file in a folder you can write")


def _bf16_logits(run_dir, images_nhwc, float32_stem: bool = False) -> torch.Tensor:
    """_plain_logits' model under plain torch's CPU autocast to bfloat16 (what a bf16 run's own
    evaluation runs in).  Its input normalized in float32, as torchvision does it: bf16 rounds
    each layer's input, and the last bit by which a float64 normalization differs flips some of
    those roundings (on a 2-core AMD EPYC without AVX512, where bf16 is emulated: softmax
    outputs 1.4e-3 apart, as far apart as the precisions these tests tell apart)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return _plain_logits(run_dir, images_nhwc, float32_stem=float32_stem,
                             float32_normalization=True)


def test_predict_runs_in_the_precision_the_run_evaluated_in(tmp_path):
    """A run trained (and evaluated) in bf16 on a CPU: predict without flags runs as the run
    ran where this CPU has native bf16 (its probabilities are the softmax of plain torch's
    bf16-autocast logits, not of the fp32 ones), in fp32 where bf16 would be emulated (as eval
    does); --mixed-precision bf16 and no give those two anywhere, and an .onnx model refuses
    a precision in one line."""
    from accel_train.train.precision import cpu_has_native_bf16
    out = tmp_path / "bf16"
    accel_train_here(*TINY_TRAIN, "--mixed-precision", "bf16", "--max-steps", "4", "--lr", "0.2",
                     "--output-dir", str(out), check=True)
    images, files = _held_out_pngs(tmp_path, 6)
    bf16 = _bf16_logits(out, images).double().softmax(dim=1)
    fp32 = _plain_logits(out, images).softmax(dim=1)
    apart = float((bf16 - fp32).abs().max())
    assert apart > 1e-4  # the two can be told apart at predict's 6 digits

    def is_bf16(got: torch.Tensor) -> bool:
        # the oracle normalizes as predict does (_bf16_logits); what is left apart is the
        # printing's 6 digits, far inside a third of what separates the two precisions
        return float((got - bf16).abs().max()) < apart / 3

    def probabilities(*flags: str) -> torch.Tensor:
        lines = _predictions(str(out), *map(str, files), *flags)
        return torch.tensor([[next(p["probability"] for p in line["predictions"]
                                   if p["index"] == c) for c in range(10)] for line in lines],
                            dtype=torch.float64)

    native = cpu_has_native_bf16()
    if native:
        assert is_bf16(probabilities())
    else:
        assert probabilities() == pytest.approx(fp32, abs=2e-6)
    assert is_bf16(probabilities("--mixed-precision", "bf16"))
    assert probabilities("--mixed-precision", "no") == pytest.approx(fp32, abs=2e-6)
    table = accel_train_here("predict", str(out), str(files[0]), check=True).stdout
    assert f"1 image(s) on cpu in {'bf16' if native else 'fp32'}" in table, table
    emulated = accel_train_here("predict", str(out), str(files[0]), "--mixed-precision", "bf16")
    assert ("no native bf16" in emulated.stderr) == (not native), emulated.stderr
    onnx = tmp_path / "model.onnx"
    onnx.write_bytes(b"not read: refused before")
    refused = accel_train_here("predict", str(onnx), str(files[0]), "--mixed-precision", "bf16")
    assert refused.returncode == 2 and refused.stderr.strip() == (
        "accel_train: error: --mixed-precision bf16: an .onnx model runs in the precision it "
        "was exported in (ONNX Runtime); drop the flag")


def test_predict_of_a_whitened_bf16_run_computes_that_layer_in_float32(tmp_path):
    """A bf16 run with --whiten-stem (test_resnet's conv1.0, every filter whitened): predict in
    bf16 gives the softmax of plain torch's bf16 logits with that one layer computed in float32
    by hand, as the run computed it, not of the all-bf16 logits."""
    out = tmp_path / "whitened"
    accel_train_here(*TINY_TRAIN, "--whiten-stem", "--mixed-precision", "bf16", "--max-steps",
                     "4", "--lr", "0.2", "--output-dir", str(out), check=True)
    images, files = _held_out_pngs(tmp_path, 6)
    as_run = _bf16_logits(out, images, float32_stem=True).double().softmax(dim=1)
    all_bf16 = _bf16_logits(out, images).double().softmax(dim=1)
    apart = float((as_run - all_bf16).abs().max())
    assert apart > 1e-4  # the two can be told apart at predict's 6 digits
    lines = _predictions(str(out), *map(str, files), "--mixed-precision", "bf16")
    got = torch.tensor([[next(p["probability"] for p in line["predictions"] if p["index"] == c)
                         for c in range(10)] for line in lines], dtype=torch.float64)
    assert float((got - as_run).abs().max()) < apart / 3


def _counting(forward, batches: list):
    """Conv2d.forward that records the batch size at each model's first (3-channel) convolution."""
    def counted(self, input):
        if self.in_channels == 3:
            batches.append(int(input.shape[0]))
        return forward(self, input)
    return counted


def test_the_eval_table_is_the_oracles_numbers(run_dir):
    """`eval RUN` without --json: the summary line and one row per class, written out here from
    the plain-torch oracle (a class without images shows '-', not a division by zero)."""
    oracle = _oracle(run_dir, *_drawn("test", 10))
    text = accel_train_here("eval", str(run_dir), "--max-samples", "10", check=True).stdout
    names = model_spec_of(run_dir)["class_names"]
    width = max(len("class"), *(len(n) for n in names))
    top1, top5 = oracle["top1_correct"] / 10, oracle["top5_correct"] / 10
    mean = oracle["mean_class_top1"]
    expected = [f"loss {oracle['loss']:.4f}  top-1 {top1:.2%}  top-5 {top5:.2%}  mean per-class "
                f"top-1 {mean:.2%}  (10 images)", "",
                f"{'class':<{width}}  {'correct':>7}  {'images':>6}  {'top-1':>7}  "
                f"{'predicted':>9}  {'precision':>9}  mostly mistaken for"]
    for name in names:
        row = oracle["per_class"][name]
        correct, count, predicted = row["correct"], row["images"], row["predicted"]
        accuracy = f"{100 * correct / count:.1f}%" if count else "-"
        precision = f"{100 * correct / predicted:.1f}%" if predicted else "-"
        mistake = row["mistaken_for"]
        confused = f"{mistake['class']} ({mistake['images']})" if mistake else "-"
        expected.append(f"{name:<{width}}  {correct:>7}  {count:>6}  {accuracy:>7}  "
                        f"{predicted:>9}  {precision:>9}  {confused}")
    assert any(oracle["per_class"][n]["images"] == 0 for n in names)  # the '-' row is seen
    assert "\n".join(expected) in text, text
    # and a class with several images, some right: its share is correct / images
    oracle = _oracle(run_dir, *_drawn("test", EVAL_SAMPLES))
    text = accel_train_here("eval", str(run_dir), check=True).stdout
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines()
            if line.split() and line.split()[0] in names}
    shown = [n for n in names if 0 < oracle["per_class"][n]["correct"]
             < oracle["per_class"][n]["images"]]
    assert shown
    for name in shown:
        correct, count = oracle["per_class"][name]["correct"], oracle["per_class"][name]["images"]
        assert rows[name][:3] == [str(correct), str(count), f"{100 * correct / count:.1f}%"]


def test_the_mean_per_class_top1_weighs_each_class_alike():
    """By hand: 9 of 9 right in one class and 0 of 1 in another is 50%, where top-1 says 90%;
    a class without held-out images is left out of the mean, not counted as 0."""
    from accel_train.train.evaluate import mean_class_top1
    assert mean_class_top1([9, 0], [9, 1]) == 0.5
    assert mean_class_top1([3, 0, 1], [4, 0, 2]) == pytest.approx((3 / 4 + 1 / 2) / 2)
    assert mean_class_top1([0, 0], [0, 0]) == 0.0


def test_the_class_each_class_is_mistaken_for_by_hand():
    """Class 0's wrong images went to 2 twice and to 1 once: 2; class 1's to 0 and 2 once
    each: a tie, the lower index (0); class 2 never wrong: None; class 3 no images: None."""
    from accel_train.train.evaluate import most_mistaken_for
    labels = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 2])
    guesses = torch.tensor([2, 1, 2, 0, 2, 0, 1, 2, 2])
    assert most_mistaken_for(labels, guesses, 4) == [(2, 2), (0, 1), None, None]
