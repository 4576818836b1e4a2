"""--host-decode-share: where the training JPEGs are decoded on the device, a share of each
batch's JPEGs is decoded by the loader workers instead (device_decode.shared_with_host).

Oracles: the positions written out by hand; the loader workers' path (`host_batch`: timm's
training transform on PIL images) for the images the share sends there, to the bit; the device
path without a share for the others, to the bit; the summary's words and the run's record.
"""

from __future__ import annotations

import pytest
import torch
import yaml

from accel_train.data.device_decode import DeviceDecoder, shared_with_host
from conftest import PINNED, accel_train_here
from test_device_decode import _dataset, photos  # noqa: F401 -- the fixture, shared


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


def _decoded(images, keys):
    encoded = images.encoded_batch(keys)
    pixels, labels, replaced = DeviceDecoder("cpu", images)(encoded.images, encoded.labels,
                                                            encoded.replaced)
    return encoded.images, pixels, labels, replaced


def test_the_workers_decode_their_share_and_the_device_the_rest(photos):  # noqa: F811
    images = _dataset(photos)
    keys = [len(images) * 2 + index for index in range(8)]  # epoch 2: 8 photos, all JPEGs
    host = images.host_batch(keys)
    _, on_device, _, _ = _decoded(images, keys)
    images.host_decode_share = 0.25
    encoded, pixels, labels, replaced = _decoded(images, keys)
    assert encoded.ready_positions.tolist() == [3, 7]
    assert encoded.positions.tolist() == [0, 1, 2, 4, 5, 6]
    for position in (3, 7):  # the workers' own pixels
        assert torch.equal(pixels[position], host.images[position]), position
    for position in (0, 1, 2, 4, 5, 6):  # the device path's, as without a share
        assert torch.equal(pixels[position], on_device[position]), position
    assert not torch.equal(on_device[3], host.images[3])  # the two paths' pixels do differ
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


@pytest.mark.parametrize("value", ["1.5", "-0.1"])
def test_a_share_outside_0_to_1_is_one_line_exit_2(value, tmp_path):
    result = accel_train_here("--dataset", "synthetic", "--host-decode-share", value,
                              "--output-dir", str(tmp_path / "run"))
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "--host-decode-share" in result.stderr \
        and "between 0 and 1" in result.stderr, result.stderr
    assert not (tmp_path / "run").exists()
