"""eval, predict, export and plot on the files of one real tiny run, trained once for the module
in a subprocess as a user would.  The commands themselves run in-process (`cli.main`) to save
the ~10 s import of torch/timm/accelerate per call; the two-process eval goes through torchrun."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import sys
import threading
from pathlib import Path

import pandas as pd
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from accel_train.data import synthetic
from accel_train.cli import main
from accel_train.run.track import read_metrics
import conftest
from conftest import (TINY_TRAIN, accel_train_here, clean_accelerate_state, free_port,
                      model_spec_of, run)

# The folder the tests write images into lists classes in another order than the model does
# (alphabetical vs synthetic.CLASS_NAMES), so eval must map labels by class name.
FOLDER_CLASSES = ["ring", "disk", "square"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("commands") / "run"
    accel_train_here(*TINY_TRAIN, "--output-dir", str(out), "--log-every", "4", check=True)
    return out


@pytest.fixture(autouse=True)
def _fresh(fresh_accelerate):
    """Every test here runs in process (conftest.fresh_accelerate)."""


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory) -> Path:
    """Synthetic test images saved as PNGs in one folder per class (no splits)."""
    root = tmp_path_factory.mktemp("images") / "by_class"
    images, labels = synthetic.generate(40, seed=11)
    for index, (image, label) in enumerate(zip(images, labels)):
        name = synthetic.CLASS_NAMES[label]
        if name in FOLDER_CLASSES:
            (root / name).mkdir(parents=True, exist_ok=True)
            Image.fromarray(image).save(root / name / f"{index:03d}.png")
    return root


def command(capsys, *argv: str) -> tuple[int, str, str]:
    with clean_accelerate_state():  # each command as in a process of its own
        code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def eval_json(capsys, *argv: str) -> dict:
    code, out, err = command(capsys, "eval", *argv, "--json")
    assert code == 0, err
    return json.loads(out.strip().splitlines()[-1])


def last_epoch(run_dir: Path) -> dict:
    return [m for m in read_metrics(run_dir / "metrics.jsonl") if m["type"] == "epoch"][-1]


def test_eval_of_a_run_repeats_its_last_epoch_numbers(run_dir, capsys):
    """The run's own held-out data, rebuilt from config.yaml, and the same numbers."""
    code, out, err = command(capsys, "eval", str(run_dir))
    assert code == 0, err
    epoch = last_epoch(run_dir)
    assert f"top-1 {epoch['eval_top1']:.2%}" in out and f"loss {epoch['eval_loss']:.4f}" in out
    assert f"({epoch['eval_count']} images)" in out
    for name in synthetic.CLASS_NAMES:  # the per-class table names every class
        assert any(line.split()[:1] == [name] for line in out.splitlines()), name
    result = eval_json(capsys, str(run_dir))
    assert result["top1"] == pytest.approx(epoch["eval_top1"])
    assert result["top5"] == pytest.approx(epoch["eval_top5"])
    assert sum(c["images"] for c in result["per_class"].values()) == result["count"] == 64
    if not torch.cuda.is_available():  # fp16 cannot run here: eval says so, in its own words
        code, out, err = command(capsys, "eval", str(run_dir), "--mixed-precision", "fp16")
        assert code == 0 and "this run evaluates in fp32" in out + err


def test_eval_runs_in_the_precision_and_memory_format_the_run_chose(run_dir, tmp_path, capsys):
    """A run trained (and evaluated at its epoch ends) in bf16 channels_last on a CPU is
    evaluated so by `eval` without flags, and gives its logged numbers; where this CPU has no
    native bf16, auto stays fp32.  An fp32 run stays fp32; a flag overrides."""
    from accel_train.train.precision import cpu_has_native_bf16
    assert eval_json(capsys, str(run_dir))["precision"] == "fp32"
    out = tmp_path / "bf16"
    accel_train_here(*TINY_TRAIN, "--mixed-precision", "bf16", "--channels-last", "--max-steps",
                     "4", "--output-dir", str(out), check=True)
    result = eval_json(capsys, str(out))
    if cpu_has_native_bf16():
        assert result["precision"] == "bf16, channels_last"
        epoch = last_epoch(out)
        assert result["loss"] == pytest.approx(epoch["eval_loss"], abs=1e-6)
        assert result["top1"] == pytest.approx(epoch["eval_top1"])
    else:
        assert result["precision"] == "fp32"
    assert eval_json(capsys, str(out), "--mixed-precision", "no")["precision"] == "fp32"
    code, printed, err = command(capsys, "eval", str(out))
    assert code == 0 and f"on cpu in {result['precision']}" in printed, printed


def test_eval_of_its_checkpoint_and_of_an_unfinished_run(run_dir, tmp_path, capsys):
    """The final checkpoint holds the final weights; a run without model.safetensors (training
    did not finish) is evaluated from its newest valid checkpoint."""
    checkpoint = run_dir / "checkpoints" / "step_00000016"
    assert (checkpoint / "model_config.json").is_file()  # every checkpoint carries its spec
    from_checkpoint = eval_json(capsys, str(checkpoint))
    unfinished = tmp_path / "unfinished"
    # the final model left out, the checkpoints' own weights kept (the copy's checkpoints are
    # what it reads: config.yaml's absolute path names the original's)
    shutil.copytree(run_dir, unfinished, ignore=lambda folder, names: (
        {"model.safetensors", "config.json"} & set(names) if Path(folder) == run_dir else ()))
    code, out, err = command(capsys, "eval", str(unfinished))
    assert code == 0, err
    assert "step_00000016 (step 16), newest valid: training did not finish" in out
    assert from_checkpoint["loss"] == pytest.approx(last_epoch(run_dir)["eval_loss"])
    # copied under another name it is still a checkpoint, verified: changed bytes are refused
    renamed = tmp_path / "best_weights"
    shutil.copytree(checkpoint, renamed)
    assert eval_json(capsys, str(renamed), "--dataset", "synthetic", "--max-samples",
                     "64")["loss"] == pytest.approx(from_checkpoint["loss"])
    weights = bytearray((renamed / "model.safetensors").read_bytes())
    weights[-4000:] = bytes(4000)
    (renamed / "model.safetensors").write_bytes(bytes(weights))
    code, _, err = command(capsys, "eval", str(renamed), "--dataset", "synthetic")
    assert code == 2 and "is not usable" in err and "checksum" in err, err


@pytest.mark.slow  # two evaluations and two predictions on photographs: 5 s on 2 cores
def test_eval_of_one_class_and_of_imagenets_validation_layout(run_dir, image_folder, tmp_path,
                                                                capsys):
    """New photographs of one class are data to evaluate on (training needs two classes, eval
    refused one); ImageNet's layout needs --val-labels, which eval did not take.  Oracle:
    predict's top-1 on the same files."""
    rings = sorted((image_folder / "ring").glob("*.png"))
    one = tmp_path / "only_rings" / "ring"
    shutil.copytree(image_folder / "ring", one)
    result = eval_json(capsys, str(run_dir), "--data-dir", str(one.parent), "--split", "all")
    predicted = predict_json(capsys, str(run_dir), str(one), "--top-k", "1")
    right = sum(row["predictions"][0]["class"] == "ring" for row in predicted)
    assert result["count"] == len(rings) and result["top1"] == pytest.approx(right / len(rings))
    layout = tmp_path / "imagenet_like"
    for name in ("ring", "disk"):
        shutil.copytree(image_folder / name, layout / "train" / name)
    (layout / "val").mkdir()
    lines = []
    for name in ("ring", "disk"):
        for path in sorted((image_folder / name).glob("*.png"))[:3]:
            shutil.copy(path, layout / "val" / f"{name}_{path.name}")
            lines.append(f"{name}_{path.name},{name}")
    (tmp_path / "val_labels.csv").write_text("\n".join(lines) + "\n")
    result = eval_json(capsys, str(run_dir), "--data-dir", str(layout), "--val-labels",
                       str(tmp_path / "val_labels.csv"))
    predicted = predict_json(capsys, str(run_dir), str(layout / "val"), "--top-k", "1")
    right = sum(row["predictions"][0]["class"] == Path(row["image"]).name.split("_")[0]
                for row in predicted)
    assert result["count"] == 6 and result["top1"] == pytest.approx(right / 6)
    code, _, err = command(capsys, "eval", str(run_dir), "--class-depth", "1")
    assert code == 2 and "describe the data of --data-dir" in err, err


def test_class_names_match_whether_composed_or_decomposed():
    """A folder copied from a Mac names 'café' as c-a-f-e + U+0301; the model, trained on the
    composed name, has the same class."""
    import unicodedata
    from types import SimpleNamespace

    from accel_train.commands.eval import align_labels
    composed = ["café", "thé"]
    decomposed = [unicodedata.normalize("NFD", name) for name in reversed(composed)]
    assert decomposed[1] != "café"
    source = SimpleNamespace(labels=torch.tensor([0, 1, 1]))
    align_labels(source, decomposed, composed, "the folder")
    assert source.labels.tolist() == [1, 0, 0]
    with pytest.raises(Exception, match="class\\(es\\) tea are not among"):
        align_labels(source, ["tea", "café"], composed, "the folder")


def test_eval_on_another_folder_maps_classes_by_name(run_dir, image_folder, capsys):
    predictions = predict_json(capsys, str(run_dir), str(image_folder), "--top-k", "1")
    agree = sum(p["predictions"][0]["class"] == Path(p["image"]).parent.name
                for p in predictions)
    result = eval_json(capsys, str(run_dir), "--data-dir", str(image_folder), "--split", "all")
    assert result["count"] == len(predictions) == sum(1 for _ in image_folder.rglob("*.png"))
    assert result["top1"] == pytest.approx(agree / len(predictions))  # two views, one answer
    assert {n for n, c in result["per_class"].items() if c["images"]} == set(FOLDER_CLASSES)


def predict_json(capsys, *argv: str) -> list[dict]:
    code, out, err = command(capsys, "predict", *argv, "--json")
    assert code == 0, err
    return [json.loads(line) for line in out.strip().splitlines()]


def test_predict_table_and_json_lines(run_dir, image_folder, capsys):
    one = sorted((image_folder / "disk").glob("*.png"))[0]
    rows = predict_json(capsys, str(run_dir), str(one), str(image_folder / "ring"), str(one),
                        "--top-k", "3")
    assert rows[0]["image"] == str(one) and len(rows) == 1 + len(list((image_folder / "ring")
                                                                      .glob("*.png")))
    for row in rows:
        probabilities = [p["probability"] for p in row["predictions"]]
        assert len(probabilities) == 3 and probabilities == sorted(probabilities, reverse=True)
        assert 0 < sum(probabilities) <= 1 + 1e-6
        assert all(p["class"] == synthetic.CLASS_NAMES[p["index"]] for p in row["predictions"])
    code, out, err = command(capsys, "predict", str(run_dir), str(one), "--top-k", "2")
    assert code == 0, err
    header, row = out.strip().splitlines()[-2:]
    assert header.split() == ["image", "top-1", "top-2"]
    top = rows[0]["predictions"][0]
    assert row.startswith(str(one)) and f"{top['class']}" in row
    assert f"{top['probability']:.1%}" in row


def test_predict_of_a_folder_leaves_out_what_training_leaves_out(run_dir, image_folder,
                                                                  tmp_path, capsys):
    """A folder copied from a Mac: `._0.png` resource forks beside each image and a
    `__MACOSX/` tree.  Training never reads them as images (imagefolder.py); predict did,
    and failed on the first.  A hidden file named explicitly is still predicted."""
    folder = tmp_path / "from_a_mac"
    shutil.copytree(image_folder / "ring", folder / "ring")
    images = sorted(p.name for p in (folder / "ring").glob("*.png"))
    fork = b"\x00\x05\x16\x07" + bytes(60)  # AppleDouble's magic: not an image
    for name in images:
        (folder / "ring" / f"._{name}").write_bytes(fork)
    (folder / "__MACOSX" / "ring").mkdir(parents=True)
    (folder / "__MACOSX" / "ring" / f"._{images[0]}").write_bytes(fork)
    shutil.copy(folder / "ring" / images[0], folder / "__MACOSX" / "ring" / images[0])
    rows = predict_json(capsys, str(run_dir), str(folder))
    assert [Path(row["image"]).name for row in rows] == images
    hidden = folder / "ring" / ".hidden.png"
    shutil.copy(folder / "ring" / images[0], hidden)
    assert [row["image"] for row in predict_json(capsys, str(run_dir), str(hidden))] == \
        [str(hidden)]


@pytest.mark.slow
def test_the_last_words_name_the_run_folder_as_a_shell_takes_it(tmp_path, capsys):
    """The end of a run suggests commands: a folder with spaces, quoted, pastes as one word."""
    out = tmp_path / "my run é"
    code, said, err = command(capsys, "--dataset", "synthetic", "--synthetic-train-size", "64",
                              "--model", "test_resnet", "--max-eval-samples", "16",
                              "--batch-size", "16", "--max-steps", "1", "--no-plots",
                              "--output-dir", str(out))
    assert code == 0, err
    assert f"next: accel-train eval {shlex.quote(str(out))}  |  accel-train predict " \
           f"{shlex.quote(str(out))} IMAGES..." in said
    assert shlex.split(said.split("next: ")[1].split("  |  ")[0]) == ["accel-train", "eval",
                                                                    str(out)]


@pytest.mark.parametrize("flags, expected", [
    (["--top-k", "0"], "--top-k must be a whole number >= 1 (got 0)"),
    (["--batch-size", "-2"], "--batch-size must be a whole number >= 1 (got -2)"),
    (["--read-timeout", "-1"], "--read-timeout must be seconds >= 0 (got -1); 0 waits for ever"),
])
def test_predict_names_the_flag_that_is_out_of_range(run_dir, image_folder, capsys, flags,
                                                      expected):
    code, _, err = command(capsys, "predict", str(run_dir), str(image_folder), *flags)
    assert code == 2 and err.strip().splitlines() == [f"accel_train: error: {expected}"], err


def test_predict_reads_an_image_from_a_pipe_as_from_its_file(run_dir, image_folder, tmp_path,
                                                             capsys):
    """`accel-train predict RUN <(curl -s URL)`: the shell passes a pipe, not a regular file;
    its image is predicted as the same bytes in a file are."""
    source = sorted((image_folder / "ring").glob("*.png"))[0]
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)

    def feed() -> None:
        with contextlib.suppress(BrokenPipeError):
            pipe.write_bytes(source.read_bytes())

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    try:
        from_pipe = predict_json(capsys, str(run_dir), str(pipe))
    finally:  # a writer still waiting for its reader (predict never opened the pipe) gets one
        os.close(os.open(pipe, os.O_RDONLY | os.O_NONBLOCK))
        writer.join(timeout=30)
    from_file = predict_json(capsys, str(run_dir), str(source))
    assert [row["image"] for row in from_pipe] == [str(pipe)]
    assert from_pipe[0]["predictions"] == from_file[0]["predictions"]


def test_predict_of_a_folder_takes_every_extension_training_takes(run_dir, image_folder,
                                                                    tmp_path, capsys):
    """A camera's .jfif and .jpe files are JPEGs that training reads from a folder (every
    extension PIL opens); predict of the folder found only eight extensions of its own."""
    folder = tmp_path / "camera"
    folder.mkdir()
    source = sorted((image_folder / "ring").glob("*.png"))[0]
    from PIL import Image
    with Image.open(source) as image:
        for name in ("a.jfif", "b.jpe", "c.jpg", "d.png"):
            image.convert("RGB").save(folder / name, format="PNG" if name == "d.png" else "JPEG")
    (folder / "notes.txt").write_text("not an image")
    rows = predict_json(capsys, str(run_dir), str(folder))
    assert [Path(row["image"]).name for row in rows] == ["a.jfif", "b.jpe", "c.jpg", "d.png"]


def test_predict_of_a_folder_follows_linked_folders_and_names_a_dangling_link(
        run_dir, image_folder, tmp_path, capsys):
    """Class folders kept elsewhere and linked in, as training, check-data and eval read them:
    predict listed no image of a linked folder (a CSV short of rows, without a word) and left a
    dangling link out silently.  Oracles: os.walk following links lists the images; each image
    reached through a link is predicted as its real file is; check-data names the dangling link
    with the same reason; a link back up is refused in one line."""
    store, folder = tmp_path / "store", tmp_path / "linked"
    shutil.copytree(image_folder / "disk", store / "disk")
    shutil.copytree(image_folder / "ring", folder / "ring")
    (folder / "disk").symlink_to(store / "disk", target_is_directory=True)
    expected = sorted(Path(top, name) for top, _, names in os.walk(folder, followlinks=True)
                      for name in names)
    assert any("disk" in path.parts for path in expected)
    rows = predict_json(capsys, str(run_dir), str(folder))
    assert [Path(row["image"]) for row in rows] == expected
    linked = {row["image"]: row["predictions"] for row in rows if "/disk/" in row["image"]}
    for row in predict_json(capsys, str(run_dir), str(store / "disk")):
        assert linked[str(folder / "disk" / Path(row["image"]).name)] == row["predictions"]
    (folder / "ring" / "zz_gone.png").symlink_to(tmp_path / "moved_away.png")
    code, out, err = command(capsys, "predict", str(run_dir), str(folder), "--csv",
                             str(tmp_path / "submission.csv"))
    assert code == 2 and not (tmp_path / "submission.csv").exists()
    assert f"{folder / 'ring' / 'zz_gone.png'} cannot be decoded (a broken symlink: its target " \
           f"{tmp_path / 'moved_away.png'} does not exist)" in err, err
    code, out, err = command(capsys, "check-data", "--data-dir", str(folder), "--json")
    assert {u["image"]: u["reason"] for u in json.loads(out)["unreadable"]} == {
        "ring/zz_gone.png": f"a broken symlink: its target {tmp_path / 'moved_away.png'} "
                            f"does not exist"}
    (folder / "ring" / "zz_gone.png").unlink()
    (store / "disk" / "up").symlink_to(folder, target_is_directory=True)  # a loop
    code, out, err = command(capsys, "predict", str(run_dir), str(folder))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "symlink loop" in err, err


def test_a_folder_entry_that_cannot_be_looked_at_is_one_line(run_dir, image_folder, tmp_path,
                                                              capsys):
    """A link to itself inside the folder (ELOOP: a listing that fails even for root, whom
    permission bits do not stop) ended predict, check-data and training in a traceback.
    Oracle: os.stat of the link raises ELOOP; each command is one line naming it, exit 2, and
    training writes no run folder."""
    import errno
    folder = tmp_path / "looped"
    shutil.copytree(image_folder / "ring", folder / "ring")
    for link in (folder / "ring" / "self", folder / "self"):  # in a subfolder, then the top
        link.symlink_to(link.name)
        with pytest.raises(OSError) as looked:
            os.stat(link)
        assert looked.value.errno == errno.ELOOP
        code, out, err = command(capsys, "predict", str(run_dir), str(folder))
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert f"{link}: " in err and "Traceback" not in err, err
    code, out, err = command(capsys, "check-data", "--data-dir", str(folder))
    assert code == 2 and len(err.strip().splitlines()) == 1 and f"{link}: " in err, err
    code, out, err = command(capsys, "--data-dir", str(folder), "--output-dir",
                             str(tmp_path / "run"), "--model", "test_resnet", "--max-steps", "1")
    assert code == 2 and len(err.strip().splitlines()) == 1 and f"{link}: " in err, err
    assert not (tmp_path / "run").exists()


def test_predict_reports_an_unreadable_image_and_predicts_the_others(run_dir, image_folder,
                                                                     tmp_path, capsys):
    folder = tmp_path / "mixed"
    shutil.copytree(image_folder / "ring", folder)
    (folder / "zz_broken.png").write_bytes(b"\x89PNG broken")  # sorted last
    code, out, err = command(capsys, "predict", str(run_dir), str(folder), "--json")
    rows = [json.loads(line) for line in out.strip().splitlines()]
    # the rows in the folder's sorted order, the unreadable one in its place
    assert [row["image"] for row in rows] == [str(p) for p in sorted(folder.glob("*.png"))]
    assert code == 2 and rows[-1]["image"].endswith("zz_broken.png") and "error" in rows[-1]
    predicted = [row for row in rows if "predictions" in row]
    assert len(predicted) == len(list((image_folder / "ring").glob("*.png"))) > 0
    assert err.strip().splitlines()[-1].startswith("accel_train: error: 1 of ")
    assert "zz_broken.png cannot be decoded" in err


def test_a_run_that_has_saved_nothing_yet_is_named_as_one(run_dir, image_folder, tmp_path,
                                                          capsys):
    """eval and predict of a run still in its first epoch (or stopped before its first save):
    the line said "expected a run directory (with model.safetensors or checkpoints/)" of a run
    directory.  Now it says the run has saved no checkpoint, and names the training that holds
    its lock.  Oracles: the lock written here with this process's pid (os.getpid); the
    run's config.yaml copied, its own checkpoint folder left absent."""
    import socket
    running = tmp_path / "running"
    running.mkdir()
    (running / "config.yaml").write_text((run_dir / "config.yaml").read_text())
    image = str(next((image_folder / "ring").glob("*.png")))
    for argv in (["eval", str(running)], ["predict", str(running), image]):
        code, out, err = command(capsys, *argv)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "stopped before its first checkpoint" in err and "expected a run" not in err, err
    (running / "run.lock").write_text(json.dumps(
        {"host": socket.gethostname(), "pid": os.getpid(), "token": "held-here"}))
    for argv in (["eval", str(running)], ["predict", str(running), image]):
        code, out, err = command(capsys, *argv)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert f"pid {os.getpid()}" in err and "has saved no checkpoint yet" in err, err


def test_predict_of_a_folder_says_which_photos_pil_cannot_open_it_leaves_out(run_dir,
                                                                            tmp_path, capsys):
    """A phone's folder, half HEIC: predict listed the JPEGs and said nothing of the rest.
    Oracle: the files written here, by extension."""
    folder = tmp_path / "phone"
    folder.mkdir()
    for i in range(2):
        Image.new("RGB", (16, 16), (80 * i, 0, 0)).save(folder / f"IMG_000{i}.JPG")
    for name in ("IMG_0002.HEIC", "IMG_0003.heic", "DSC_0004.NEF"):
        (folder / name).write_bytes(b"\x00\x00\x00\x18ftypheic")
    (folder / "notes.txt").write_text("not a photo: not counted")
    code, out, err = command(capsys, "predict", str(run_dir), str(folder), "--json")
    assert code == 0, err
    assert len(out.strip().splitlines()) == 2, out  # one JSON line per JPEG
    assert (f"warning: 3 photo(s) under {folder} left out (.heic 2, .nef 1): a format PIL does "
            f"not open (phones' HEIC, cameras' raw files); convert them to JPEG or PNG") in err


def test_a_copied_run_folder_reads_its_own_checkpoints(run_dir, tmp_path, capsys):
    """config.yaml records the checkpoint folder as an absolute path: a copy of the run folder
    (another disk, another machine) without its final model read the original's checkpoints
    while the original was there.  Oracle: the copy's own checkpoint path, by shutil's copy."""
    copy = tmp_path / "copied_run"
    shutil.copytree(run_dir, copy)
    (copy / "model.safetensors").unlink()
    code, out, err = command(capsys, "eval", str(copy), "--max-samples", "16")
    assert code == 0, err
    assert f"from checkpoint {copy}/checkpoints/step_00000016 (step 16)" in out, out
    assert str(run_dir) not in out, out


def test_export_of_a_checkpoint_is_a_model_eval_and_predict_accept(run_dir, tmp_path, capsys):
    export_dir = tmp_path / "export"
    code, out, err = command(capsys, "export", str(run_dir / "checkpoints" / "step_00000016"),
                             "--output-dir", str(export_dir))
    assert code == 0, err
    assert sorted(p.name for p in export_dir.iterdir()) == ["README.md", "config.json",
                                                            "model.safetensors"]
    # the card counts the images as the run recorded them (256 trained, 64 for validation)
    card = (export_dir / "README.md").read_text()
    assert ("; 256 training images, 64 for validation (the sample limits kept a seeded draw of "
            "each split: --sample-subset random).\n") in card, card
    assert "ONNX" not in card.split("## Training")[0]  # no ONNX file: none is mentioned
    exported, final = (load_file(str(d / "model.safetensors")) for d in (export_dir, run_dir))
    assert exported.keys() == final.keys()
    assert all(torch.equal(exported[k], final[k]) for k in final)  # step 16 is the last step
    assert model_spec_of(export_dir) == model_spec_of(run_dir)
    epoch = last_epoch(run_dir)
    on_run_data = eval_json(capsys, str(export_dir), "--dataset", "synthetic",
                            "--max-samples", "64")
    assert on_run_data["top1"] == pytest.approx(epoch["eval_top1"])
    code, _, err = command(capsys, "export", str(run_dir), "-o", str(export_dir))
    assert code == 2 and "already holds an export (model.safetensors)" in err


def test_eval_of_an_export_without_data_names_the_data_it_was_trained_on(tmp_path, monkeypatch,
                                                                       capsys):
    """An export carries the training command, whose --data-dir is relative to where training
    ran: eval asks for --data-dir in one line naming that folder, and does not read it by
    itself, even where the same relative path exists here (it may be other data)."""
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    images, labels = synthetic.generate(16, seed=3)
    for index, (image, label) in enumerate(zip(images, labels)):
        folder = work / "data" / "shapes" / synthetic.CLASS_NAMES[int(label) % 2]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(folder / f"{index}.png")
    monkeypatch.chdir(work)
    accel_train_here("--data-dir", "data/shapes", "--model", "test_resnet", "--batch-size", "8",
                     "--epochs", "1", "--progress", "log", "--no-plots", *conftest.PINNED,
                     "--output-dir", str(tmp_path / "run"), check=True)
    accel_train_here("export", str(tmp_path / "run"), "-o", str(tmp_path / "export"), check=True)
    elsewhere.mkdir()
    shutil.copytree(work / "data", elsewhere / "data")  # the same relative path, here too
    monkeypatch.chdir(elsewhere)
    code, out, err = command(capsys, "eval", str(tmp_path / "export"))
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines() == [
        f"accel_train: error: export {tmp_path / 'export'} has no run config.yaml saying what "
        f"it was trained on; pass --data-dir PATH: it was trained on --data-dir data/shapes "
        f"(relative to the folder training ran in)"]


def test_eval_of_an_export_of_a_hub_or_synthetic_run_names_its_dataset(run_dir, tmp_path, capsys):
    accel_train_here("export", str(run_dir), "-o", str(tmp_path / "export"), check=True)
    code, out, err = command(capsys, "eval", str(tmp_path / "export"))
    assert code == 2
    assert err.strip().endswith("pass --data-dir PATH or --dataset NAME: it was trained on "
                                "--dataset synthetic"), err


def test_export_names_its_files_under_the_folder_as_typed(run_dir, tmp_path, monkeypatch, capsys):
    """docs/commands.md's transcript: `--output-dir exports/cifar` lists `exports/cifar/...`, as
    training's `saved runs/r1/model.safetensors` names the folder the user gave."""
    monkeypatch.chdir(tmp_path)
    code, out, err = command(capsys, "export", str(run_dir), "--output-dir", "exports/tiny")
    assert code == 0, err
    listed = [line.strip() for line in out.splitlines() if line.startswith("  -> ")]
    assert listed == [f"-> exports/tiny/{name}" for name in sorted(os.listdir("exports/tiny"))]


@pytest.mark.slow
def test_a_checkpoints_ema_weights_through_eval_export_and_predict(run_dir, image_folder,
                                                                     tmp_path, capsys):
    """--ema: the averaged weights the checkpoint kept (--model-ema).  The run's own epoch-end
    evaluation of its average is the oracle for eval; export copies those tensors as they are
    (read back by safetensors) and says they are the EMA's; predict of the checkpoint agrees
    with predict of that export.  Where there is one set of weights, or no average, one line."""
    out = tmp_path / "ema_run"
    accel_train_here(*TINY_TRAIN, "--model-ema", "--model-ema-decay", "0.5", "--output-dir",
                     str(out), check=True)
    checkpoint = out / "checkpoints" / "step_00000016"
    epoch = last_epoch(out)
    averaged = eval_json(capsys, str(checkpoint), "--ema")
    assert averaged["loss"] == pytest.approx(epoch["eval_ema_loss"], abs=1e-6)
    assert averaged["top1"] == pytest.approx(epoch["eval_ema_top1"])
    trained = eval_json(capsys, str(checkpoint))
    assert trained["loss"] == pytest.approx(epoch["eval_loss"], abs=1e-6)
    assert averaged["loss"] != pytest.approx(trained["loss"], abs=1e-6)
    export_dir = tmp_path / "ema_export"
    code, printed, err = command(capsys, "export", str(checkpoint), "--ema", "-o", str(export_dir))
    assert code == 0 and "its EMA weights" in printed, err
    exported, kept = (load_file(str(path)) for path in
                      (export_dir / "model.safetensors", checkpoint / "ema.safetensors"))
    assert exported.keys() == kept.keys()
    assert all(torch.equal(exported[k], kept[k]) for k in kept)
    assert json.loads((export_dir / "config.json").read_text())["accel_train"]["weights"] == "ema"
    assert predict_json(capsys, str(checkpoint), str(image_folder), "--ema") == \
        predict_json(capsys, str(export_dir), str(image_folder))
    (export_dir / "model.onnx").write_bytes(b"not read: refused before")
    code, _, err = command(capsys, "predict", str(export_dir / "model.onnx"),
                           str(image_folder), "--ema")
    assert code == 2 and "--ema: an .onnx model holds the weights it was exported with" in err
    for argv, words in (((str(run_dir / "checkpoints" / "step_00000016"),), "holds no EMA weights"),
                        ((str(out),), "holds one set of weights"),
                        ((str(export_dir),), "holds one set of weights")):
        code, _, err = command(capsys, "eval", *argv, "--ema")
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
def test_an_export_whose_data_is_gone_says_what_its_checks_ran_on(image_folder, tmp_path,
                                                                   capsys):
    """The run's image folder deleted: export goes on without held-out numbers, its note
    gives the reason without eval's remedy (export takes no --data-dir), and the card says
    the ONNX check ran on random inputs, not "on held-out images"."""
    pytest.importorskip("onnxruntime")
    data = tmp_path / "pngs"
    shutil.copytree(image_folder, data)
    run = tmp_path / "run"
    accel_train_here("--data-dir", str(data), "--model", "test_resnet", "--batch-size", "8",
                     "--max-steps", "2", "--progress", "log", "--no-plots", "--output-dir",
                     str(run), check=True)
    shutil.rmtree(data)
    code, out, err = command(capsys, "export", str(run), "-o", str(tmp_path / "export"),
                             "--format", "onnx")
    assert code == 0, err
    assert "note: no held-out accuracy in the model card: the run's data is not reachable" in out
    assert "--data-dir PATH" not in out and "on 16 random inputs (no held-out images:" in out
    card = (tmp_path / "export" / "README.md").read_text()
    assert "within" in card and "on 16 random inputs (`accel-train predict" in card
    assert "on held-out images" not in card


def test_plot_command_writes_the_pngs(run_dir, tmp_path, capsys):
    plots = run_dir / "plots"
    before = sorted(plots.iterdir()) if plots.exists() else []
    code, out, err = command(capsys, "plot", str(run_dir), "--output-dir", str(tmp_path / "a"))
    assert code == 0, err
    written = [Path(line) for line in out.strip().splitlines()]
    assert sorted(p.name for p in written) == ["accuracy.png", "loss_lr.png", "throughput.png"]
    assert all(p.parent == tmp_path / "a" for p in written)  # where it was told, only there
    assert (sorted(plots.iterdir()) if plots.exists() else []) == before
    for path in written:
        with Image.open(path) as image:
            assert image.format == "PNG" and image.size == (800, 600)
    code, out, err = command(capsys, "plot", str(run_dir), "-o", str(tmp_path / "b"))
    assert code == 0 and sorted(p.name for p in (tmp_path / "b").iterdir()) == \
        ["accuracy.png", "loss_lr.png", "throughput.png"]


def test_bad_input_is_one_line_with_the_fix(run_dir, tmp_path, capsys):
    broken = tmp_path / "step_00000016"
    shutil.copytree(run_dir / "checkpoints" / "step_00000016", broken)
    with (broken / "model.safetensors").open("r+b") as handle:  # one flipped byte
        handle.seek(-1, 2)
        last = handle.read(1)
        handle.seek(-1, 2)
        handle.write(bytes([last[0] ^ 1]))
    not_an_image = tmp_path / "notes.png"
    not_an_image.write_text("not an image")
    images = synthetic.generate(10, seed=3)[0]
    for index, image in enumerate(images):  # a class the model does not know, and one it does
        folder = tmp_path / "other" / ("dog" if index % 2 else "disk")
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(folder / f"{index}.png")
    stopped = tmp_path / "stopped"  # a run stopped before its first logged steps
    stopped.mkdir()
    shutil.copy(run_dir / "config.yaml", stopped)
    cases = [
        (["eval", str(tmp_path / "nowhere")], "no such run directory, checkpoint or export"),
        (["export", str(broken), "-o", str(tmp_path / "x")], "does not match its checksum"),
        (["predict", str(run_dir), str(not_an_image)], "notes.png cannot be decoded"),
        (["eval", str(run_dir), "--data-dir", str(tmp_path / "other"), "--split", "all"],
         "class(es) dog are not among the model's 10 classes"),
        (["plot", str(tmp_path)], "no metrics.jsonl there"),
        (["plot", str(stopped)], f"{stopped}: the run logged no step yet (metrics.jsonl comes "
                                 f"with the first --log-every steps); plot again after them"),
        (["evl", str(run_dir)], "unknown subcommand 'evl'; choose from train, eval, predict,"),
        (["eval", str(run_dir), "--max-samples", "0"], "expected a whole number >= 1 or 'all'"),
        (["eval", str(run_dir), "--loader-timeout", "-1"],
         "--loader-timeout must be seconds >= 0 (got -1.0)"),
        (["shard", "--data-dir", str(tmp_path / "other"), "--output", str(tmp_path / "x"),
          "--read-timeout", "nan"], "--read-timeout must be seconds >= 0 (got nan)"),
    ]
    for argv, message in cases:
        code, _, err = command(capsys, *argv)
        assert code == 2, argv
        # (datasets may draw a progress bar above it while it reads a folder)
        errors = [line for line in err.splitlines() if "error" in line]
        assert len(errors) == 1 and message in errors[0], (argv, err)
        assert errors[0].startswith("accel_train: error: ") and err.rstrip().endswith(errors[0])
    assert not (tmp_path / "x").exists()


def torchrun(*args: str):
    return run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                "-m", "accel_train", *args], env=conftest.test_env(), check=True)


@pytest.mark.slow
def test_two_process_run_and_eval_agree_with_one_process_eval(tmp_path, capsys):
    """A run trained on 2 processes, evaluated on 2 and on 1: three views of one model.
    61 images in batches of 8 on 2 ranks: the sampler pads the last batch and gather_for_metrics
    must drop the padding.  The training-time eval must use rank 0's BatchNorm statistics (the
    saved ones), not each rank its own."""
    out = tmp_path / "ddp"
    torchrun(*TINY_TRAIN, "--max-steps", "4", "--max-eval-samples", "61", "--batch-size", "8",
             "--output-dir", str(out))
    logged = last_epoch(out)
    # (one launch for both: --json keeps the report to its JSON line beside the CSV)
    printed = torchrun("eval", str(out), "--json", "--mistakes", str(tmp_path / "two.csv")).stdout
    lines = [line for line in printed.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # printed by the main process only
    double, single = json.loads(lines[0]), eval_json(capsys, str(out))
    assert double["processes"] == 2 and single["processes"] == 1
    assert double["count"] == single["count"] == logged["eval_count"] == 61
    for key in ("loss", "top1", "top5"):
        assert double[key] == pytest.approx(single[key], rel=1e-5), key
        assert single[key] == pytest.approx(logged[f"eval_{key}"], rel=1e-5), key
    assert double["per_class"] == single["per_class"]
    # each wrong image named by its key, not by its place in what the ranks gathered
    code, _, err = command(capsys, "eval", str(out), "--mistakes", str(tmp_path / "one.csv"))
    assert code == 0, err
    two, one = (pd.read_csv(tmp_path / name) for name in ("two.csv", "one.csv"))
    assert len(one) == 61 - round(single["top1"] * 61) > 0
    assert two[["image", "class", "predicted"]].equals(one[["image", "class", "predicted"]])
    assert (two["class_probability"] - one["class_probability"]).abs().max() < 1e-5


def test_a_metrics_file_cut_short_or_damaged(run_dir, tmp_path, capsys):
    """A run killed while it wrote metrics.jsonl leaves a partial last line: plot draws without
    it and says so once; a line damaged in the middle is one line naming the file and line."""
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("checkpoints", "plots"))
    lines = (copy / "metrics.jsonl").read_text().splitlines()
    (copy / "metrics.jsonl").write_text("\n".join(lines) + "\n" + lines[-1][:17])
    code, out, err = command(capsys, "plot", str(copy))
    assert code == 0 and len(out.strip().splitlines()) == 3
    assert err.count("is cut short") == 1 and "Traceback" not in err

    (copy / "metrics.jsonl").write_text("\n".join([lines[0], "{garbage", *lines[1:]]) + "\n")
    code, out, err = command(capsys, "plot", str(copy))
    assert code == 2 and err.strip() == (f"accel_train: error: {copy / 'metrics.jsonl'} line 2 is "
                                         f"not a metrics record ('{{garbage'); the file is "
                                         f"damaged: remove that line or restore the file")
