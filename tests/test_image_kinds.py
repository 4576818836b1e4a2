"""The kinds of image file people collect, decoded (accel_train/data/decode.py) or named as broken.

Oracles: numpy for the expected pixels (EXIF orientation from the EXIF table, 16-bit values
v >> 8, transparency composited over white, CMYK's subtractive formula), the pixels the files
were made from, and each file's own bytes for the broken ones.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

import imagekinds as kinds
from accel_train.config import TrainConfig
from accel_train.data.decode import Unreadable, decode, decode_many, jpeg_header, \
    read_value
from accel_train.base.errors import UsageError
from accel_train.data.sources import load_data


def hwc(tensor: torch.Tensor) -> np.ndarray:
    assert tensor.dtype == torch.uint8 and tensor.shape[0] == 3
    return tensor.permute(1, 2, 0).numpy()


@pytest.mark.parametrize("name", list(kinds.broken_files()))
def test_each_kind_of_broken_file_is_unreadable_with_its_reason(name):
    data, words = kinds.broken_files()[name]
    with pytest.raises(Unreadable, match=words):
        decode(data)
    assert isinstance(decode_many([kinds.encoded(kinds.pixels(0), "PNG"), data])[1], Unreadable)


@pytest.mark.parametrize("data, reason", [
    (b"<!DOCTYPE html><html><body>403 Forbidden</body></html>\n",
     "not an image: the file holds text ('<!DOCTYPE html><html><body>403'...)"),
    (b"Access denied.\r\n\tPlease   sign in first.",  # whitespace runs become one space
     "not an image: the file holds text ('Access denied. Please sign in '...)"),
    (("x" + "\u0414" * 40).encode(),  # the 64-byte head ends inside a 2-byte character
     "not an image: the file holds text ('x" + "\u0414" * 29 + "'...)"),
    (b"A" * 64 + b"\x00\x01", "not an image: the file holds text ('" + "A" * 30 + "'...)"),
    (b"   \n  ", "not an image format PIL can read (first bytes 2020200a2020)"),
    (b"", "empty file: 0 bytes"),
    (b"\xff\xfe not utf8 \x80\x81",
     "not an image format PIL can read (first bytes fffe206e6f742075)"),
    (bytes(range(256)), "not an image format PIL can read (first bytes 0001020304050607)"),
], ids=["html", "whitespace", "cut-character", "text-head", "blank", "empty", "not-utf8",
        "control-bytes"])
def test_a_file_that_is_no_image_is_named_by_what_it_holds(data, reason):
    """The reason quotes the file (oracle: the literal sentences, counted by hand): printable
    text as its first 30 characters with whitespace runs as one space, anything else as its
    first 8 bytes in hex; only the first 64 bytes are looked at."""
    with pytest.raises(Unreadable) as caught:
        decode(data)
    assert str(caught.value) == reason


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_applied_to_jpeg_and_png(orientation):
    array = kinds.pixels(orientation, 12, 20)
    # PNG is lossless: the oracle is the original array turned with numpy.
    png = decode(kinds.exif_oriented_png(array, orientation))
    assert np.array_equal(hwc(png), kinds.oriented(array, orientation))
    # JPEG: the same compressed pixels with orientation 1, turned with numpy; both decoders
    # (torchvision's batched one, and PIL's for the ones it cannot take) agree.
    upright = hwc(decode(kinds.exif_oriented_jpeg(array, 1)))
    jpeg = kinds.exif_oriented_jpeg(array, orientation)
    assert np.array_equal(hwc(decode(jpeg)), kinds.oriented(upright, orientation))
    assert np.array_equal(hwc(decode(jpeg, fast=False)), kinds.oriented(upright, orientation))
    assert np.array_equal(hwc(decode_many([jpeg, jpeg])[1]), kinds.oriented(upright, orientation))


def test_16_bit_png_is_scaled_to_8_bits_not_clipped():
    values = np.arange(0, 65536, 257, dtype=np.uint16)[:240].reshape(12, 20)  # 0 .. 61423
    gray = hwc(decode(kinds.png16_gray(values)))
    assert np.array_equal(gray, np.repeat((values >> 8).astype(np.uint8)[:, :, None], 3, 2))
    assert gray.max() == 61423 >> 8  # not 255 everywhere above 255, as a plain convert gives
    rgb_values = np.random.default_rng(1).integers(0, 65536, (6, 7, 3)).astype(np.uint16)
    assert np.array_equal(hwc(decode(kinds.png16_rgb(rgb_values))),
                          (rgb_values >> 8).astype(np.uint8))


def test_animated_gif_gives_its_first_frame():
    image = hwc(decode(kinds.animated_gif([(255, 0, 0), (0, 0, 255), (0, 255, 0)])))
    assert image.shape == (8, 8, 3) and (image == [255, 0, 0]).all()


def test_palette_with_transparency_is_composited_over_white():
    data, indices, palette = kinds.palette_with_transparency()
    expected = palette[indices]
    expected[indices == 0] = 255  # index 0 is transparent
    assert np.array_equal(hwc(decode(data)), expected)


def test_rgba_is_composited_over_white():
    data, rgba = kinds.rgba_png()
    alpha = rgba[:, :, 3:].astype(np.float64) / 255
    expected = rgba[:, :, :3] * alpha + 255 * (1 - alpha)
    assert np.abs(hwc(decode(data)).astype(np.float64) - expected).max() <= 0.5 + 1e-9


def test_every_level_and_alpha_pair_goes_to_the_nearest_level_over_white():
    """All 256 x 256 (level, alpha) pairs: a few of them (level 127 at alpha 1, say) sit 0.502
    from one level and 0.498 from the next, where a rounding off by one would show."""
    level, alpha = np.meshgrid(np.arange(256), np.arange(256), indexing="ij")
    rgba = np.stack([level, level, level, alpha], axis=2).astype(np.uint8)
    expected = level * (alpha / 255) + 255 * (1 - alpha / 255)
    decoded = hwc(decode(kinds.encoded(rgba, "PNG"))).astype(np.float64)
    assert np.abs(decoded - expected[:, :, None]).max() < 0.5


def test_cmyk_becomes_rgb_by_the_subtractive_formula_and_both_jpeg_decoders_agree():
    data, cmyk = kinds.cmyk_tiff()
    c, m, y, k = (cmyk[:, :, i].astype(np.float64) for i in range(4))
    expected = np.stack([(255 - ink) * (255 - k) / 255 for ink in (c, m, y)], axis=2)
    assert np.abs(hwc(decode(data)).astype(np.float64) - expected).max() <= 1
    jpeg = kinds.cmyk_jpeg()
    assert torch.equal(decode(jpeg), decode(jpeg, fast=False))


def test_a_lists_jpegs_go_to_the_jpeg_decoder_in_one_call_and_the_rest_to_pil(monkeypatch):
    """decode_many hands every JPEG of the list to the JPEG decoder (jpeg_decoders.py) in one
    call (the reason it exists: a batch of CIFAR-10 is JPEG); PIL opens only the others.  Both
    decoders give the same pixels here, so only this watch sees a JPEG that went to PIL.  The
    oracle for the pixels: PIL's own decode of each file."""
    import accel_train.data.decode as decode_module
    from accel_train.data.jpeg_decoders import jpeg_decoder
    if jpeg_decoder() is None:
        pytest.skip("neither torchvision nor TorchCodec decodes JPEGs here: every file goes to "
                    "PIL")
    files = [kinds.encoded(kinds.pixels(1), "JPEG"), kinds.encoded(kinds.pixels(2), "PNG"),
             kinds.encoded(kinds.pixels(3), "JPEG")]
    expected = [np.asarray(Image.open(io.BytesIO(f)).convert("RGB")) for f in files]
    batches, opened = [], []
    real_batch, real_pixels = decode_module._decode_jpegs, decode_module._rgb_pixels
    monkeypatch.setattr(decode_module, "_decode_jpegs",
                        lambda blobs: batches.append(len(blobs)) or real_batch(blobs))
    # PIL's decodes, not its header reads (the pixel limit is read from each JPEG's header)
    monkeypatch.setattr(decode_module, "_rgb_pixels",
                        lambda pil: opened.append(pil.format) or real_pixels(pil))
    results = decode_many(files)
    assert batches == [2] and opened == ["PNG"], (batches, opened)
    for result, pixels in zip(results, expected):
        assert np.array_equal(hwc(result), pixels)
    assert np.array_equal(hwc(decode(files[2])), expected[2])  # one file: the same way
    assert batches == [2, 1] and len(opened) == 1, (batches, opened)


def test_a_pil_image_is_taken_as_it_is():
    """What a Hugging Face Image column hands over when it decodes itself: a PIL image."""
    array = kinds.pixels(4)
    assert np.array_equal(hwc(decode(Image.fromarray(array))), array)


@pytest.mark.filterwarnings("ignore:Corrupt EXIF")
def test_a_file_pil_only_warns_about_still_decodes():
    """Corrupt EXIF is a warning in PIL, not an error: the pixels still come.  Only the
    decompression bomb's warning is made an error."""
    array = kinds.pixels(5)
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, "PNG", exif=b"Exif\x00\x00II*\x00\x08\x00\x00\x00\xff\xff")
    assert np.array_equal(hwc(decode(buffer.getvalue())), array)


def test_a_decompression_bomb_is_unreadable_naming_pils_limit():
    """9500 x 9500 pixels (90.25 million, over PIL's default 89,478,485) in a few kB: never
    decoded, whatever its format."""
    with pytest.raises(Unreadable, match=r"9500x9500 = 90,250,000 pixels, over PIL's "
                                         r"decompression-bomb limit of 89,478,485 "
                                         r"\(PIL.Image.MAX_IMAGE_PIXELS\)"):
        decode(kinds.bomb_png())


def test_the_pixel_limit_is_pils_and_holds_for_the_fast_jpeg_decoder_too(monkeypatch):
    """Over the limit a PNG is unreadable; a JPEG is decoded at half its size (within it)."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    png = kinds.encoded(kinds.pixels(0, 12, 10), "PNG")
    with pytest.raises(Unreadable, match="10x12 = 120 pixels, over PIL's decompression-bomb "
                                         "limit of 100"):
        decode(png)
    assert isinstance(decode_many([png])[0], Unreadable)
    jpeg = kinds.encoded(kinds.pixels(0, 12, 10), "JPEG")
    assert decode(jpeg).shape == decode_many([jpeg])[0].shape == (3, 6, 5)
    assert decode(kinds.encoded(kinds.pixels(0, 10, 10), "PNG")).shape == (3, 10, 10)


@pytest.mark.parametrize("limit, reduction", [(3000, 2), (800, 4), (200, 8)])
def test_a_jpeg_over_the_pixel_limit_is_decoded_at_the_largest_reduction_within_it(
        monkeypatch, limit, reduction):
    """A 100-megapixel camera's photo is over PIL's limit: libjpeg's DCT scaling decodes it at
    1/2, 1/4 or 1/8 of its size, the largest within the limit.  Oracle: PIL's full decode
    (its limit lifted by hand) reduced by the same factor with PIL's box filter, EXIF
    orientation applied by PIL's exif_transpose; the DCT's scaling is near it, not equal."""
    height, width = 96, 80
    gradient = np.add.outer(np.arange(height) * 2, np.arange(width) * 3) % 256
    array = np.stack([gradient, gradient[::-1], np.full_like(gradient, 90)], axis=2)
    buffer = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6  # a quarter turn: the sides swap
    Image.fromarray(array.astype(np.uint8)).save(buffer, "JPEG", quality=95, exif=exif)
    blob = buffer.getvalue()
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    full = ImageOps.exif_transpose(Image.open(io.BytesIO(blob))).convert("RGB")
    expected = np.asarray(full.reduce(reduction)).astype(int)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", limit)
    for image in (decode(blob), decode_many([blob])[0]):
        got = hwc(image).astype(int)
        assert got.shape == expected.shape == (width // reduction, height // reduction, 3)
        assert np.abs(got - expected).mean() < 4, np.abs(got - expected).mean()


def test_a_jpeg_over_64_times_the_limit_is_unreadable(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(Unreadable, match="90x80 = 7,200 pixels, over PIL's decompression-bomb"):
        decode(kinds.encoded(kinds.pixels(0, 80, 90), "JPEG"))


def test_the_reductions_edges(monkeypatch):
    """Half of 20x10 is 50 pixels: at a limit of 50 it is within (not a quarter); a 2x400 JPEG
    is 50 pixels at 1/8 by its sides' ceilings, but libjpeg cannot scale a side of 2 below 1,
    so it is still 200: unreadable; a truncated one over the limit is named as truncated."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 50)
    assert decode(kinds.encoded(kinds.pixels(0, 10, 20), "JPEG")).shape == (3, 5, 10)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(Unreadable) as thin:
        decode(kinds.encoded(kinds.pixels(0, 400, 2), "JPEG"))
    assert str(thin.value) == ("2x400 = 800 pixels, over PIL's decompression-bomb limit of 100 "
                               "(PIL.Image.MAX_IMAGE_PIXELS)")
    whole = kinds.encoded(kinds.pixels(0, 80, 60), "JPEG")
    with pytest.raises(Unreadable, match=r"^truncated file \("):
        decode(whole[:len(whole) // 2])


def test_every_broken_file_in_a_folder_is_named_by_its_path(tmp_path):
    """Broken files among good ones, in class folders: the default substitutes each and names
    it (path relative to --data-dir, and why); --bad-images error stops at the first, naming it."""
    kinds.write_folder(tmp_path, per_class=8, held_out=2)
    broken = kinds.broken_files()
    for i, (name, (data, _)) in enumerate(broken.items()):
        (tmp_path / "train" / ("ant", "bee")[i % 2] / f"x_{name}").write_bytes(data)
    data = load_data(TrainConfig(data_dir=str(tmp_path)))
    named = {bad.name: bad.reason for bad in data.bad_images}
    assert named.keys() == {f"train/{('ant', 'bee')[i % 2]}/x_{name}"
                            for i, name in enumerate(broken)}
    for i, (name, (_, words)) in enumerate(broken.items()):
        assert words in named[f"train/{('ant', 'bee')[i % 2]}/x_{name}"]
    assert len(data.train) == 2 * 8 + len(broken)  # an epoch keeps its length
    with pytest.raises(UsageError, match=r"image train/(ant|bee)/x_\w+\.\w+ cannot be decoded "
                                         r"\(.*\); remove or replace that file"):
        load_data(TrainConfig(data_dir=str(tmp_path), bad_images="error"))


# read_value: what a `datasets` Image value, a path or a PIL image gives the decoder.  Oracles:
# the bytes written to disk by the test and the sentences a user reads in the bad-image report.

def test_a_value_with_bytes_gives_those_bytes_and_never_reads_its_path(tmp_path):
    other = tmp_path / "other.png"
    other.write_bytes(b"the file on disk")
    assert read_value({"bytes": b"in the row", "path": str(other)}) == b"in the row"


def test_a_value_with_only_a_path_reads_that_file(tmp_path):
    (tmp_path / "a.png").write_bytes(b"on disk")
    assert read_value({"bytes": None, "path": str(tmp_path / "a.png")}) == b"on disk"
    assert read_value(tmp_path / "a.png") == b"on disk"          # a bare path too


def test_relative_paths_are_read_under_the_root_and_absolute_ones_as_they_are(tmp_path,
                                                                             monkeypatch):
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "a.png").write_bytes(b"under the root")
    (tmp_path / "a.png").write_bytes(b"in the working folder")
    monkeypatch.chdir(tmp_path)
    assert read_value("a.png", root=tmp_path / "root") == b"under the root"
    assert read_value("a.png") == b"in the working folder"              # no root: as given
    assert read_value(str(tmp_path / "a.png"), root=tmp_path / "root") == b"in the working folder"


def test_a_missing_or_unreadable_file_and_a_foreign_value_say_why_in_words(tmp_path,
                                                                          monkeypatch):
    # an indexed folder's file was there; a path stored in the data may never have been
    with pytest.raises(Unreadable) as gone:
        read_value({"bytes": None, "path": "gone.png"}, root=tmp_path)
    assert gone.value.reason == "the file is gone (deleted or moved since the data was indexed)"
    with pytest.raises(Unreadable) as stored:
        read_value({"bytes": None, "path": str(tmp_path / "gone.png")})
    assert stored.value.reason == f"no file at {tmp_path / 'gone.png'}"
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Unreadable) as relative:
        read_value({"bytes": None, "path": "photos/gone.png"})
    assert relative.value.reason == (f"no file at {tmp_path / 'photos' / 'gone.png'}: a relative "
                                     f"path, read from the current folder")
    with pytest.raises(Unreadable) as folder:
        read_value(tmp_path)                                    # a folder: OSError, its strerror
    assert folder.value.reason == "cannot read the file (Is a directory)"
    with pytest.raises(Unreadable) as foreign:
        read_value(42)
    assert foreign.value.reason == "not an image value (got int)"


# -- JPEGs in a batch, and no JPEG decoder ---------------------------------------------------------
def _jpeg(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG")
    return out.getvalue()


def _torchvision_pixels(blob: bytes) -> torch.Tensor:
    from torchvision.io import ImageReadMode, decode_jpeg
    return decode_jpeg(torch.frombuffer(bytearray(blob), dtype=torch.uint8),
                       mode=ImageReadMode.RGB)


def test_a_broken_jpeg_among_good_ones_costs_only_itself():
    """torchvision's batched decoder refuses the whole list for one bad JPEG; each is then
    decoded alone, and PIL names what is wrong with the bad one."""
    good = [_jpeg(16, 12, 0), _jpeg(12, 16, 1)]
    broken = b"\xff\xd8\xff\xe0" + b"not jpeg data " * 10
    results = decode_many([good[0], broken, good[1]])
    assert torch.equal(results[0], _torchvision_pixels(good[0]))
    assert torch.equal(results[2], _torchvision_pixels(good[1]))
    assert isinstance(results[1], Unreadable) and str(results[1]).startswith("truncated file (")


def test_a_non_square_jpeg_over_the_pixel_limit_is_decoded_at_half_its_size(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 150)
    fits, over = _jpeg(16, 8, 0), _jpeg(20, 8, 1)  # 128 and 160 pixels (8 x 8 = 64 for both)
    results = decode_many([fits, over])
    assert torch.equal(results[0], _torchvision_pixels(fits))
    assert results[1].shape[1:] == (_torchvision_pixels(over).shape[1] // 2,
                                    _torchvision_pixels(over).shape[2] // 2), results[1].shape


@pytest.fixture
def no_jpeg_decoder(monkeypatch):
    """Neither torchvision's JPEG decoder (its import fails, as if removed) nor TorchCodec (not
    installed); the decoder is looked up again under that, and again after."""
    import sys

    from accel_train.data import jpeg_decoders
    for name in ("torchvision.io", "torchcodec", "torchcodec.decoders"):
        monkeypatch.setitem(sys.modules, name, None)
    jpeg_decoders._found.cache_clear()
    assert jpeg_decoders.jpeg_decoder() is None
    yield
    jpeg_decoders._found.cache_clear()


def test_without_a_jpeg_decoder_pil_decodes_them(no_jpeg_decoder):
    blobs = [_jpeg(16, 12, 0), _jpeg(8, 8, 1)]
    for blob, image in zip(blobs, decode_many(blobs)):
        expected = np.array(Image.open(io.BytesIO(blob)).convert("RGB"))
        assert torch.equal(image, torch.from_numpy(expected).permute(2, 0, 1))


def test_a_truncated_png_is_named_so():
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (12, 16, 3), dtype=np.uint8)).save(
        out, format="PNG")
    with pytest.raises(Unreadable) as caught:
        decode(out.getvalue()[:len(out.getvalue()) // 2])
    assert str(caught.value) == "truncated file (image file is truncated)"


def test_gray_with_alpha_is_blended_over_white_like_rgba():
    """An LA image (gray + alpha) gets the blend RGBA images get: (v x a + 255 x (255 - a) +
    127) // 255 per channel, computed here in numpy."""
    gray = np.array([[0, 100], [200, 255]], dtype=np.uint8)
    alpha = np.array([[0, 128], [255, 37]], dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(np.stack([gray, alpha], axis=2), mode="LA").save(out, format="PNG")
    g, a = gray.astype(np.int64), alpha.astype(np.int64)
    expected = ((g * a + 255 * (255 - a) + 127) // 255).astype(np.uint8)
    image = decode(out.getvalue())
    assert torch.equal(image, torch.from_numpy(np.repeat(expected[None], 3, axis=0)))


def test_a_jpeg_over_the_pixel_limit_is_never_handed_to_the_fast_decoder(monkeypatch):
    """libjpeg allocates the whole image before anything checks its size (a 5 MB JPEG of
    20000x20000 took 1.3 GB), so the limit is read from the header first.  Oracle: PIL's own
    header size of each file the decoder is handed, against PIL's limit."""
    from accel_train.data import decode as decode_module
    from accel_train.data.jpeg_decoders import jpeg_decoder

    real = jpeg_decoder()
    if real is None:
        pytest.skip("no fast JPEG decoder in this environment")
    handed = []

    def spying(blobs, device, turns):
        handed.extend(Image.open(io.BytesIO(blob.numpy().tobytes())).size for blob in blobs)
        return real.decode(blobs, device, turns)

    monkeypatch.setattr(decode_module, "jpeg_decoder", lambda: type(real)(real.library, spying))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    # 120 pixels: PIL only warns when it opens it; 210, over twice the limit: PIL refuses
    small, large, larger = (kinds.encoded(kinds.pixels(0, 10, 10), "JPEG"),
                            kinds.encoded(kinds.pixels(0, 12, 10), "JPEG"),
                            kinds.encoded(kinds.pixels(0, 21, 10), "JPEG"))
    results = decode_many([small, large, larger])
    # (over the limit: PIL's reduced decode, at half the size)
    assert [tuple(image.shape) for image in results] == [(3, 10, 10), (3, 6, 5), (3, 11, 5)]
    assert handed and all(width * height <= Image.MAX_IMAGE_PIXELS for width, height in handed)


def test_the_device_paths_header_check_says_nothing_of_a_file_over_the_limit(monkeypatch):
    """A JPEG between the limit and twice it (PIL warns as it opens one) goes the host way
    without a DecompressionBombWarning on stderr from every loader worker at every epoch: the
    host decode says what it does with it.  Under the limit, the size as PIL reads it."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    small, large = (kinds.encoded(kinds.pixels(0, 10, 10), "JPEG"),
                    kinds.encoded(kinds.pixels(0, 12, 10), "JPEG"))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert jpeg_header(large) is None
        assert jpeg_header(small) == (10, 10, 1)
    assert [str(w.message) for w in said] == []


HEIC_REASON = ("a HEIC photo, a format PIL does not open (phones save photos in it): convert it "
               "to JPEG or PNG")


@pytest.mark.parametrize("head, reason", [
    (b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic", HEIC_REASON),  # an iPhone's
    (b"\x00\x00\x00\x1cftypmif1\x00\x00\x00\x00mif1heicmiaf", HEIC_REASON),  # HEIC compatible
    (b"\x00\x00\x00\x18ftypisom\x00\x00\x02\x00isommp41",  # an MP4 video: no HEIC brand
     "not an image format PIL can read (first bytes 0000001866747970)"),
    (b"\x00\x00\x00\x10ftypmp41\x00\x00\x00\x00heic",  # "heic" after the box's 16 bytes
     "not an image format PIL can read (first bytes 0000001066747970)"),
], ids=["heic-major", "heic-compatible", "mp4", "heic-outside-the-box"])
def test_a_heic_photo_is_named_as_one(head, reason):
    """A phone's HEIC photo is named with what to do, not by its first bytes in hex.  Oracle:
    the ftyp boxes written by hand after ISO/IEC 14496-12 (size, 'ftyp', major brand, minor
    version, compatible brands) with HEIF's brand 'heic' (ISO/IEC 23008-12)."""
    with pytest.raises(Unreadable) as caught:
        decode(head + bytes(100))
    assert str(caught.value) == reason
