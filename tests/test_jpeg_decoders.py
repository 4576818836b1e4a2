"""JPEG decoding through torchvision's decoder, TorchCodec's where torchvision has none left, and
PIL where neither is there (accel_train/data/jpeg_decoders.py): the environments a user may
have, made here by taking torchvision's `decode_jpeg` away (as a torchvision that dropped its
deprecated decoders would be) and by making `torchcodec` unimportable (not installed) or
failing to load (a wheel built for another torch).

Oracles: PIL's decoding with `ImageOps.exif_transpose` (both libraries are libjpeg-turbo, as
PIL is: the same pixels); the product's own results with torchvision's decoder, for the same
files and draws, when TorchCodec decodes instead.
"""

from __future__ import annotations

import io
import sys
import threading
import time
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.io
from PIL import Image, ImageOps

from accel_train.base.errors import UsageError
from accel_train.config import TrainConfig
from accel_train.data import device_decode, jpeg_decoders
from accel_train.data.decode import Unreadable, decode_many
from accel_train.data.device_decode import DeviceDecoder, choose
from accel_train.data.loaders import TrainImages, run_transforms
from accel_train.data.sources import load_data
from conftest import PINNED, accel_train_here, run

CPU = torch.device("cpu")


def _photo(rng, width: int, height: int, mode: str = "RGB") -> Image.Image:
    coarse = rng.uniform(0, 255, (6, 8, 3)).astype(np.uint8)
    return Image.fromarray(coarse).resize((width, height), Image.BICUBIC).convert(mode)


def _jpeg(image: Image.Image, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, format="JPEG", **options)
    return out.getvalue()


def _exif(orientation: int) -> Image.Exif:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif


@pytest.fixture(scope="module")
def kinds() -> dict[str, bytes]:
    """JPEGs of the kinds met in collections: 4:2:0, 4:2:2 and 4:4:4 chroma, progressive,
    grayscale, odd sizes, and each EXIF orientation (a value outside 1-8 among them)."""
    rng = np.random.default_rng(0)
    found = {"420": _jpeg(_photo(rng, 64, 48), quality=85),
             "422": _jpeg(_photo(rng, 50, 31), quality=90, subsampling=1),
             "444": _jpeg(_photo(rng, 33, 17), quality=95, subsampling=0),
             "progressive": _jpeg(_photo(rng, 70, 40), quality=80, progressive=True),
             "gray": _jpeg(_photo(rng, 40, 30, "L"), quality=90)}
    for orientation in (*range(1, 9), 9, 0):
        found[f"exif{orientation}"] = _jpeg(_photo(rng, 41, 23), quality=90,
                                            exif=_exif(orientation))
    return found


def _pil(blob: bytes) -> np.ndarray:
    return np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(blob))).convert("RGB"))


def _tensors(blobs) -> list[torch.Tensor]:
    return [torch.frombuffer(bytearray(blob), dtype=torch.uint8) for blob in blobs]


@pytest.fixture
def environment(monkeypatch):
    """Makes the environment a test asks for: `environment("no torchvision")`, then also
    "no torchcodec" or "torchcodec broken"; the decoder is looked up again under it, and again
    once the test is over."""
    def make(*removed: str) -> None:
        for what in removed:
            if what == "no torchvision":
                monkeypatch.delattr(torchvision.io, "decode_jpeg")
            elif what == "no torchcodec":  # (None in sys.modules: an ImportError, as when
                monkeypatch.setitem(sys.modules, "torchcodec", None)  # not installed)
                monkeypatch.setitem(sys.modules, "torchcodec.decoders", None)
            else:  # a wheel built for another torch: its library fails to load
                broken = types.ModuleType("torchcodec.decoders")

                def fails(name):
                    raise OSError("libtorchcodec_core9.so: undefined symbol: _ZN3c10")
                broken.__getattr__ = fails
                monkeypatch.setitem(sys.modules, "torchcodec", types.ModuleType("torchcodec"))
                monkeypatch.setitem(sys.modules, "torchcodec.decoders", broken)
        jpeg_decoders._found.cache_clear()

    jpeg_decoders._found.cache_clear()  # looked up by this test itself
    yield make
    jpeg_decoders._found.cache_clear()


@pytest.mark.parametrize("library", ["torchvision", "torchcodec"])
def test_each_library_decodes_as_pil_does_with_the_exif_orientation(kinds, library, monkeypatch,
                                                                   environment):
    if library == "torchcodec":
        environment("no torchvision")
    decoder = jpeg_decoders.jpeg_decoder()
    assert decoder.library == library and jpeg_decoders.missing() == ""
    images = decoder.decode(_tensors(kinds.values()), CPU, None)
    for (name, blob), image in zip(kinds.items(), images):
        assert np.array_equal(image.permute(1, 2, 0).numpy(), _pil(blob)), (library, name)
    # The orientations given (the device path reads them from the headers in its workers): the
    # same images; torchvision turns them itself then, as on CUDA.
    turns = [jpeg_decoders.exif_orientation(blob) for blob in kinds.values()]
    assert turns[-10:] == [*range(1, 9), 1, 1]  # (9 and 0 are no orientation: taken as stored)
    for image, again in zip(images, decoder.decode(_tensors(kinds.values()), CPU, turns)):
        assert torch.equal(image, again)


def test_torchvisions_decoder_turns_the_images_by_the_orientations_it_is_handed(kinds,
                                                                                 environment):
    """Its CUDA call cannot read EXIF, so the orientations the workers read are applied after
    decoding, on either device (here the CPU runs that code): handed "upright" for every file,
    it gives each as stored."""
    decoder = jpeg_decoders.jpeg_decoder()
    assert decoder.library == "torchvision"
    stored = decoder.decode(_tensors(kinds.values()), CPU, [1] * len(kinds))
    for (name, blob), image in zip(kinds.items(), stored):
        as_stored = np.asarray(Image.open(io.BytesIO(blob)).convert("RGB"))
        assert np.array_equal(image.permute(1, 2, 0).numpy(), as_stored), name


def test_an_unreadable_header_has_no_orientation():
    assert jpeg_decoders.exif_orientation(b"\xff\xd8\xff\xe1 not a header") == 1
    assert jpeg_decoders.exif_orientation(b"") == 1


@pytest.mark.parametrize("library", ["torchvision", "torchcodec"])
def test_a_file_either_library_cannot_decode_raises_what_the_callers_catch(kinds, library,
                                                                         environment):
    if library == "torchcodec":
        environment("no torchvision")
    decoder = jpeg_decoders.jpeg_decoder()
    good = kinds["420"]
    for bad in (good[:len(good) // 3], b"\xff\xd8\xff" + b"\x00" * 40):
        with pytest.raises(jpeg_decoders.DECODE_ERRORS):
            decoder.decode(_tensors([good, bad]), CPU, None)


@pytest.mark.parametrize("library", ["torchvision", "torchcodec"])
def test_a_refused_list_is_decoded_file_by_file_to_find_the_bad_ones(kinds, library,
                                                                     environment):
    """each_or_none: the good files as PIL decodes them, None in the bad files' places, the
    orientations handed on with their own files."""
    if library == "torchcodec":
        environment("no torchvision")
    decoder = jpeg_decoders.jpeg_decoder()
    good = [kinds["420"], kinds["exif6"], kinds["gray"], kinds["exif3"]]
    cut = good[0][:len(good[0]) // 3]
    blobs = [good[0], cut, good[1], good[2], b"\xff\xd8\xff" + b"\x00" * 40, good[3]]
    calls = []

    def decode(data, turns):
        calls.append(len(data))
        return decoder.decode(data, CPU, turns)

    for turns in (None, [1, 1, 6, 1, 1, 3]):
        calls.clear()
        images = jpeg_decoders.each_or_none(decode, _tensors(blobs), turns)
        assert calls == [6, 1, 1, 1, 1, 1, 1]  # the list, then each file alone
        assert [image is None for image in images] == [False, True, False, False, True, False]
        for image, blob in zip([images[0], images[2], images[3], images[5]], good):
            assert np.array_equal(image.permute(1, 2, 0).numpy(), _pil(blob))
    if library == "torchvision":  # which turns the images by what it is handed
        stored = jpeg_decoders.each_or_none(decode, _tensors(blobs), [1] * 6)[2]
        as_stored = np.asarray(Image.open(io.BytesIO(good[1])).convert("RGB"))
        assert np.array_equal(stored.permute(1, 2, 0).numpy(), as_stored)
    calls.clear()
    assert len(jpeg_decoders.each_or_none(decode, _tensors(good), None)) == 4 and calls == [4]
    assert jpeg_decoders.each_or_none(decode, _tensors([cut]), None) == [None]


def _decoded(items: list) -> list:
    return [str(result) if isinstance(result, Unreadable) else result.numpy()
            for result in decode_many(items)]


def test_decoding_is_the_same_with_torchcodec_and_with_pil_alone(kinds, environment):
    """decode_many (every JPEG the data's loaders decode) gives the same tensors, and the same
    reason for a broken file, whichever library decodes, PIL's own path included."""
    truncated = kinds["444"][:200]
    items = [*kinds.values(), truncated, kinds["gray"]]
    with_torchvision = _decoded(items)
    environment("no torchvision")
    assert jpeg_decoders.jpeg_decoder().library == "torchcodec"
    with_torchcodec = _decoded(items)
    environment("no torchcodec")
    assert jpeg_decoders.jpeg_decoder() is None
    with_pil = _decoded(items)
    for name, a, b, c in zip([*kinds, "truncated", "gray again"], with_torchvision,
                             with_torchcodec, with_pil):
        if isinstance(a, str):
            assert a == b == c and "truncated" in a, (name, a, b, c)
        else:
            assert np.array_equal(a, b) and np.array_equal(a, c), name
    assert np.array_equal(with_pil[0].transpose(1, 2, 0), _pil(kinds["420"]))


@pytest.fixture(scope="module")
def turned_photos(tmp_path_factory) -> Path:
    """An image folder of 300-400 px JPEGs in 2 classes, every EXIF orientation among them."""
    root = tmp_path_factory.mktemp("turned")
    rng = np.random.default_rng(1)
    for split, count in (("train", 8), ("val", 1)):
        for k, label in enumerate("ab"):
            (root / split / label).mkdir(parents=True)
            for i in range(count):
                width, height = (int(v) for v in rng.integers(300, 401, 2))
                (root / split / label / f"{i}.jpg").write_bytes(
                    _jpeg(_photo(rng, width, height), quality=85,
                          exif=_exif(1 + (i + 4 * k) % 8)))
    return root


def _device_batch(root: Path) -> torch.Tensor:
    config = TrainConfig(data_dir=str(root), in_memory="never", image_size=96)
    images = TrainImages(load_data(config).train, run_transforms(config, _spec())[0], seed=3)
    keys = list(range(len(images)))
    encoded = images.encoded_batch(keys)
    pixels, labels, _ = DeviceDecoder(CPU, images)(encoded.images, encoded.labels,
                                                   encoded.replaced)
    assert torch.equal(labels, images.host_batch(keys).labels)
    return pixels


def _spec():
    return types.SimpleNamespace(image_size=96, mean=(0.5,) * 3, std=(0.25,) * 3,
                                 crop_pct=0.875, crop_mode="center", interpolation="bicubic")


def test_the_device_path_makes_the_same_samples_with_torchcodec(turned_photos, environment):
    """--decode-on-device's decoder (here on the CPU): TorchCodec turns each image itself, the
    workers drew each crop in the turned image from PIL's reading of the header, and the
    batch is the one torchvision's decoder gives, to the bit (both libjpeg-turbo)."""
    with_torchvision = _device_batch(turned_photos)
    environment("no torchvision")
    assert jpeg_decoders.jpeg_decoder().library == "torchcodec"
    assert torch.equal(_device_batch(turned_photos), with_torchvision)


def test_a_file_the_decoder_turns_otherwise_than_the_header_says_is_decoded_on_the_host(
        turned_photos, monkeypatch):
    """Where the decoder's image is not the size the workers drew its crop in (it was turned a
    quarter otherwise than PIL read the header: TorchCodec reads EXIF itself), that file goes
    the host path's way, as a refused file does.  Here a decoder that turns nothing: the
    quarter-turned images (orientations 5-8) are then the host's, the same samples within the
    resizers' rounding, and the upright ones (1) its own, to the bit."""
    expected = _device_batch(turned_photos)
    unturned = jpeg_decoders.JpegDecoder("unturned", lambda blobs, device, turns: [
        torchvision.io.decode_image(blob, mode=torchvision.io.ImageReadMode.RGB)
        for blob in blobs])
    monkeypatch.setattr(device_decode, "jpeg_decoder", lambda: unturned)
    got = _device_batch(turned_photos)
    source = load_data(TrainConfig(data_dir=str(turned_photos))).train
    turns = [jpeg_decoders.exif_orientation(blob)
             for blob in source.files_at(list(range(len(got))))]
    assert sorted(set(turns)) == list(range(1, 9)), turns
    difference = (got.int() - expected.int()).abs().float().mean(dim=(1, 2, 3))
    for k, turn in enumerate(turns):
        if turn == 1:
            assert torch.equal(got[k], expected[k]), k
        if turn >= 5:
            assert difference[k] < 1.0, (k, turn, difference)


def test_without_any_decoder_the_device_path_is_refused_in_one_line(turned_photos, environment):
    environment("no torchvision", "no torchcodec")
    said = jpeg_decoders.missing()
    assert said == ("this torchvision has no JPEG decoder (TorchCodec's replaces it) and "
                    "TorchCodec is not installed: pip install torchcodec"), said
    config = TrainConfig(data_dir=str(turned_photos), in_memory="never", image_size=96)
    data = load_data(config)
    transform = run_transforms(config, _spec())[0]
    with pytest.raises(UsageError, match="^--decode-on-device always: this torchvision has no "
                                         "JPEG decoder .* pip install torchcodec; use "
                                         "--decode-on-device auto or never$"):
        choose("always", data.train, transform, cuda=True, streaming=False)

    def never_timed():
        raise AssertionError("auto timed a path it cannot take")
    assert choose("auto", data.train, transform, cuda=True, streaming=False,
                  rates=never_timed) == (False, "", 0.0)
    # the command itself: one line, exit 2, nothing written
    out = turned_photos.parent / "refused_run"
    result = accel_train_here("--data-dir", str(turned_photos), "--decode-on-device", "always",
                              "--in-memory", "never", "--batch-size", "8", "--model", "test_resnet",
                              *PINNED, "--output-dir", str(out))
    assert result.returncode == 2 and not out.exists(), result.stderr
    assert "pip install torchcodec" in result.stderr.strip().splitlines()[-1]


def test_a_torchcodec_that_fails_to_load_is_named_with_its_error(environment):
    environment("no torchvision", "torchcodec broken")
    assert jpeg_decoders.jpeg_decoder() is None
    assert jpeg_decoders.missing() == (
        "this torchvision has no JPEG decoder (TorchCodec's replaces it) and TorchCodec did not "
        "load (OSError: libtorchcodec_core9.so: undefined symbol: _ZN3c10): pip install "
        "torchcodec")


def test_decoding_on_a_second_thread_leaves_the_first_threads_warning_filters_alone(kinds):
    """The device path decodes on a thread of its own (data/decode_ahead.py) while the training
    thread runs.  Python keeps one list of warning filters for the process, and
    `warnings.catch_warnings` saves and restores that list: a decode wrapped in one would, as
    it ended, put back under the training thread the filters of the moment it began (the
    training thread's own catch_warnings undone, or the decoder's "ignore" left in force).
    Here the first thread sets a filter again and again while the second decodes."""
    decoder = jpeg_decoders.jpeg_decoder()
    blobs = _tensors(kinds.values())
    before = list(warnings.filters)
    stop, decoded = threading.Event(), []

    def decode_until_stopped():
        while not stop.is_set():
            decoded.append(len(decoder.decode(blobs, CPU, None)))

    thread = threading.Thread(target=decode_until_stopped)
    thread.start()
    undone = 0
    try:
        started = time.monotonic()
        # 1.5 s and 10 decodes at least (a loaded machine's thread may start late), 60 at most
        while time.monotonic() - started < (1.5 if len(decoded) >= 10 else 60):
            with warnings.catch_warnings():
                warnings.simplefilter("error", UserWarning)
                mine = warnings.filters[0]
                time.sleep(0.0005)  # the decoding thread runs meanwhile
                undone += warnings.filters[0] is not mine
    finally:
        stop.set()
        thread.join()
    assert len(decoded) >= 10 and set(decoded) == {len(blobs)}, decoded
    assert undone == 0, f"the first thread's filter was undone {undone} times"
    assert warnings.filters == before


@pytest.mark.slow  # a new process
def test_a_process_that_decodes_shows_nothing_of_torchvisions_deprecation(kinds, tmp_path):
    """torchvision 0.29 warns at every decode that its decoders are deprecated: the product
    filters that one message for its process, so a process that makes it an error (`python -W
    error:MESSAGE`) decodes, on the training thread and on a second one, as the device path does.
    Only that message is made an error: another library's deprecation is not this test's."""
    (tmp_path / "photo.jpg").write_bytes(kinds["420"])
    script = f"""
import threading
from pathlib import Path
import torch
from accel_train.data.jpeg_decoders import jpeg_decoder
blob = torch.frombuffer(bytearray(Path({str(tmp_path / "photo.jpg")!r}).read_bytes()),
                        dtype=torch.uint8)
shapes = []
def decode():
    shapes.append(tuple(jpeg_decoder().decode([blob], torch.device("cpu"), None)[0].shape))
decode()
thread = threading.Thread(target=decode)
thread.start()
thread.join()
print(shapes)
"""
    message = "The image decoding and encoding capabilities of TorchVision are deprecated"
    result = run([sys.executable, "-W", f"error:{message}:DeprecationWarning", "-c", script],
                 check=True)
    assert result.stdout.strip() == "[(3, 48, 64), (3, 48, 64)]", result.stdout
    assert "deprecated" not in result.stderr, result.stderr
