"""--host-decode-share: where the training JPEGs are decoded on the device, a share of each
batch's JPEGs is decoded, cropped, resized and flipped by the loader workers instead
(device_decode.shared_with_host), their colour jitter left to the device with the rest.

Oracles: the positions written out by hand; the device path without a share, to the bit (on a
CPU the device's decoder and resize are the workers': the share must change where the work is
done, not a pixel); torchvision's own ColorJitter functions for the jitter left to the device;
the summary's words and the run's record.
"""

from __future__ import annotations

import pytest
import torch
import yaml

from accel_train.data.device_decode import DeviceDecoder, shared_with_host
from conftest import PINNED, accel_train_here
from test_device_decode import SIZE, _dataset, photos, with_a_garbled_jpeg  # noqa: F401 -- the fixture


@pytest.mark.parametrize("count, share, expected", [
    (8, 0.25, [3, 7]),     # every fourth
    (10, 0.3, [3, 6, 9]),  # 0.3 x (j + 1) passes 1, 2, 3 at j = 3, 6, 9
    (5, 0.5, [1, 3]),      # floor(2.5): two of five
    (4, 1.0, [0, 1, 2, 3]),
    (6, 0.0, []),
    (3, 0.2, []),          # floor(0.6): none of three
])
def test_the_share_is_spread_evenly_over_the_batch(count, share, expected):
    assert shared_with_host(count, share) == expected


def _decoded(images, keys, device="cpu"):
    encoded = images.encoded_batch(keys)
    pixels, labels, replaced = DeviceDecoder(device, images)(encoded.images, encoded.labels,
                                                             encoded.replaced)
    return encoded.images, pixels.cpu(), labels, replaced


def test_the_workers_decode_their_share_and_the_device_the_rest(photos):  # noqa: F811
    images = _dataset(photos)
    keys = [len(images) * 2 + index for index in range(8)]  # epoch 2: 8 photos, all JPEGs
    host = images.host_batch(keys)
    plain, on_device, _, _ = _decoded(images, keys)
    images.host_decode_share = 0.25
    encoded, pixels, labels, replaced = _decoded(images, keys)
    assert encoded.shared_positions.tolist() == [3, 7] and len(encoded.ready_positions) == 0
    assert encoded.positions.tolist() == [0, 1, 2, 4, 5, 6] and len(encoded.lengths) == 6
    assert encoded.shared.shape == (2, 3, SIZE, SIZE) and encoded.shared.dtype == torch.uint8
    # each image's draws travel with it: the device's six rows, then the two shared ones
    assert torch.equal(encoded.jitter_order, plain.jitter_order[[0, 1, 2, 4, 5, 6, 3, 7]])
    assert torch.equal(encoded.jitter_factors, plain.jitter_factors[[0, 1, 2, 4, 5, 6, 3, 7]])
    assert torch.equal(pixels, on_device)  # every image, the shared ones too, to the bit
    assert torch.equal(labels, host.labels) and torch.equal(replaced, host.replaced)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
def test_the_shared_crops_wait_for_the_devices_colour_jitter(photos, device):  # noqa: F811
    """The workers' crops are the device path's before its jitter: torchvision's own
    adjust_brightness/contrast/saturation on the device, in each image's drawn order with its
    factors, turn them into the device path's pixels to the bit; with --color-jitter 0 they
    are final."""
    from torchvision.transforms import functional as F
    images = _dataset(photos)
    keys = [len(images) + index for index in range(8)]
    images.host_decode_share = 1.0
    encoded, pixels, _, _ = _decoded(images, keys, device)
    assert encoded.shared_positions.tolist() == list(range(8)) and not encoded.lengths
    adjust = {0: F.adjust_brightness, 1: F.adjust_contrast, 2: F.adjust_saturation}
    for row, position in enumerate(encoded.shared_positions.tolist()):
        image = encoded.shared[row].to(device)
        for part in encoded.jitter_order[row].tolist():
            if part != 3:  # hue is off
                image = adjust[part](image, float(encoded.jitter_factors[row, part]))
        assert torch.equal(image.cpu(), pixels[position]), position
    assert not torch.equal(encoded.shared, pixels[encoded.shared_positions])  # it did jitter

    unjittered = _dataset(photos, color_jitter=0.0)
    unjittered.host_decode_share = 1.0
    encoded, pixels, _, _ = _decoded(unjittered, keys, device)
    assert encoded.jitter_order is None and torch.equal(pixels, encoded.shared)


def test_a_shared_file_the_decoder_refuses_is_finished_the_workers_whole_way(photos,  # noqa: F811
                                                                             tmp_path):
    """A shared JPEG whose header reads but whose data is noise: the workers' own path
    (host_samples: timm's transform) makes it, in its place, as it makes a file the device
    refuses; the other shared files stay the device path's."""
    images = _dataset(with_a_garbled_jpeg(photos, tmp_path / "photos"))
    keys = list(range(len(images)))
    garbled = next(i for i in keys if images.source.name(i).endswith("z_garbled.jpg"))
    host = images.host_batch(keys)
    _, on_device, _, _ = _decoded(images, keys)
    images.host_decode_share = 1.0
    encoded, pixels, labels, replaced = _decoded(images, keys)
    assert encoded.ready_positions.tolist() == [garbled] and not encoded.lengths
    assert torch.equal(pixels[garbled], host.images[garbled])
    others = [k for k in keys if k != garbled]
    assert encoded.shared_positions.tolist() == others
    assert torch.equal(pixels[others], on_device[others])
    assert torch.equal(labels, host.labels) and torch.equal(replaced, host.replaced)


def test_a_run_with_a_share_says_so_and_records_it(photos, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    said = accel_train_here("--data-dir", str(photos), "--model", "test_resnet", "--image-size",
                            "96", "--batch-size", "4", "--max-steps", "2", "--in-memory",
                            "never", "--num-workers", "0", "--decode-on-device", "always",
                            "--host-decode-share", "0.5", "--progress", "log", "--no-plots",
                            *PINNED, "--output-dir", str(out), check=True).stdout
    assert ("\n  JPEGs decoded on the device (--decode-on-device always); 50% of each batch's "
            "by the loader workers (--host-decode-share 0.5)\n") in said, said
    recorded = yaml.safe_load((out / "config.yaml").read_text())["train"]
    assert recorded["host_decode_share"] == 0.5, recorded


def test_a_batch_with_nothing_finished_on_the_host_is_left_as_it_is_by_the_pin_thread(
        photos):  # noqa: F811
    """The pin-memory thread pins only pixels finished on the host: a batch of JPEGs alone
    (no share, none refused) asks nothing of it, so even a machine without a GPU, where
    pinning raises, passes it through; its bytes are never pinned."""
    images = _dataset(photos)
    batch = images.encoded_batch(list(range(8))).images
    assert batch.shared is None and len(batch.ready) == 0 and len(batch.lengths) == 8
    passed = batch.pin_memory()
    assert passed.data is batch.data and passed.ready is batch.ready and passed.shared is None
    assert torch.equal(passed.positions, batch.positions)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_the_gpu_the_pin_memory_thread_pins_the_shared_crops(photos):  # noqa: F811
    """Through a DataLoader with pin_memory as the run builds one on a GPU: the workers' crops
    arrive pinned (the decoding thread then only queues their copy), the JPEG bytes as they
    were, and the batch decodes to the same pixels as one never pinned."""
    from accel_train.data.loaders import make_loader
    images = _dataset(photos)
    images.decodes_on_device, images.host_decode_share = True, 0.5
    keys = list(range(8))
    pinned, labels, _, replaced = next(iter(make_loader(images, 8, 0, 2, False, True,
                                                       sampler=keys)))
    assert pinned.shared.is_pinned() and len(pinned.shared) == 4
    assert not pinned.data.is_pinned()
    plain = images.encoded_batch(keys)
    assert torch.equal(pinned.shared, plain.images.shared)
    decoder = DeviceDecoder("cuda", images)
    assert torch.equal(decoder(pinned, labels, replaced)[0].cpu(),
                       decoder(plain.images, plain.labels, plain.replaced)[0].cpu())


@pytest.mark.parametrize("value", ["1.5", "-0.1"])
def test_a_share_outside_0_to_1_is_one_line_exit_2(value, tmp_path):
    result = accel_train_here("--dataset", "synthetic", "--host-decode-share", value,
                              "--output-dir", str(tmp_path / "run"))
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "--host-decode-share" in result.stderr \
        and "between 0 and 1" in result.stderr, result.stderr
    assert not (tmp_path / "run").exists()


def test_auto_times_the_workers_share_on_a_view_of_the_runs_images(photos):  # noqa: F811
    """What --decode-on-device auto times the workers' share on (device_decode.sharing_all): their
    batches as the share of every JPEG, crops made, nothing left for the device to decode;
    the run's own images untouched."""
    from accel_train.data.device_decode import EncodedImages
    from accel_train.data.device_decode import sharing_all
    from accel_train.data.loading import machine_workers_rate
    images = _dataset(photos)
    view = sharing_all(images)
    keys = list(range(8))
    batch = view.__getitems__(keys)
    assert isinstance(batch.images, EncodedImages) and not batch.images.lengths
    assert batch.images.shared_positions.tolist() == keys
    assert (images.decodes_on_device, images.host_decode_share) == (False, 0.0)
    assert machine_workers_rate(view, 0, 1) > 0
