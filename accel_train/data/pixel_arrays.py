"""An image column of pixel arrays instead of image files (transformers' `pixel_values`, a numpy
conversion saved with `save_to_disk` or to parquet): which ones train, and the column as the
sources read it.

datasets' own cast of such a column to `Image` raises on CxHxW and float arrays (a traceback
where a user needs one line), so arrays are read as they are and decode.py's `array_image` makes
each a PIL image, decoded as a file's would be.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from accel_train.base.errors import UsageError
from accel_train.data.decode import array_layout


def _array_feature(feature) -> Optional[tuple[str, Optional[tuple]]]:
    """(element dtype, shape or None where not declared) of an array column's feature (datasets'
    Array2D/3D, or lists of lists as pandas writes numpy arrays to parquet); None for others."""
    import datasets
    arrays = tuple(getattr(datasets, f"Array{n}D") for n in range(2, 6))
    # List and LargeList came with datasets 4; before, a list was Sequence or a Python [feature]
    lists = tuple(kind for kind in (getattr(datasets, name, None)
                                    for name in ("List", "LargeList", "Sequence"))
                  if isinstance(kind, type)) + (list,)
    if isinstance(feature, arrays):
        return feature.dtype, tuple(feature.shape)
    if not isinstance(feature, lists):
        return None
    while isinstance(feature, lists):
        feature = feature[0] if isinstance(feature, list) else feature.feature
    return (feature.dtype if isinstance(feature, datasets.Value) else "?"), None


def check_pixel_arrays(dataset, column: str) -> None:
    """An image column of arrays (transformers' `pixel_values`, a numpy conversion) trains where
    they are plainly pixels: whole numbers, HxW or 1/3/4 channels first or last (decode.py's
    array_image).  Floats are refused in one line: an image processor's output is resized and
    normalized already, by a mean and std the column does not record, so training could neither
    undo it reliably nor crop, augment and normalize as it does for images; floats that are
    pixels scaled to [0, 1] are as likely, and cannot be told apart."""
    found = _array_feature(dataset.features[column])
    if found is None:
        return
    dtype, shape = found
    if shape is None or None in shape:  # lists: the first row's shape
        shape = np.asarray(dataset.with_format("numpy")[0][column]).shape if len(dataset) \
            else ()
    what = f"the image column {column!r} holds {dtype} arrays of shape {tuple(shape)}"
    if "int" not in dtype:
        why = ("floats are an image processor's output (resized and normalized already, which "
               "training cannot undo) or pixels scaled to [0, 1], and the two cannot be told "
               "apart" if "float" in dtype else "not pixels")
        raise UsageError(f"{what}, not 8-bit pixels: {why}; pass the images from before the "
                         f"processor (an Image column, or uint8 pixel arrays of 0..255), or "
                         f"name another column with --image-column")
    if array_layout(tuple(shape)) is None:
        raise UsageError(f"{what}, neither HxW, HxWxC nor CxHxW with C 1, 3 or 4 channels; "
                         f"store the images as an Image column or uint8 HxWx3 arrays, or name "
                         f"another column with --image-column")
    if dtype != "uint8":  # (uint8 cannot leave 0..255)
        refuse_values_beyond_8_bits(dataset, column, what)


def refuse_values_beyond_8_bits(dataset, column: str, what: str) -> None:
    """Whole numbers of a wider type (uint16, int32, pandas' int64) train as the 8-bit pixels
    they are where every value lies in 0..255.  Values outside (16-bit images, a label map)
    are refused here, once, naming the range: image by image, every row was counted as a
    broken image (decode.array_image), a run's worth of warnings for one wrong column."""
    found = _value_range(dataset, column)
    if found is None or (found[0] >= 0 and found[1] <= 255):
        return
    low, high = found
    raise UsageError(f"{what} with values from {low} to {high}, outside the 0..255 of 8-bit "
                     f"pixels; pass uint8 pixel arrays of 0..255 (16-bit images divided by "
                     f"257, say) or the images themselves (an Image column), or name another "
                     f"column with --image-column")


def _value_range(dataset, column: str) -> Optional[tuple[int, int]]:
    """(smallest, largest) value in an array column's rows, None where it holds none: one
    pass of Arrow's min_max over the rows' values (the rows a selection kept), no copy."""
    import pyarrow as pa
    import pyarrow.compute as pc
    lows, highs = [], []
    for chunk in dataset.with_format("arrow")[column].chunks:
        if isinstance(chunk, pa.ExtensionArray):  # datasets' ArrayND: lists underneath
            chunk = chunk.storage
        while (pa.types.is_list(chunk.type) or pa.types.is_large_list(chunk.type)
               or pa.types.is_fixed_size_list(chunk.type)):
            chunk = chunk.flatten()  # (a sliced list array flattens to its own values only)
        extremes = pc.min_max(chunk)
        if extremes["min"].is_valid:
            lows.append(extremes["min"].as_py())
            highs.append(extremes["max"].as_py())
    return (min(lows), max(highs)) if lows else None


def image_files(dataset, column: str):
    """`dataset` whose image column holds undecoded files (datasets.Image(decode=False), so
    that decode.py decodes each as training does), or pixel arrays as they are: datasets'
    cast of an array to Image raises on CxHxW or float arrays (check_pixel_arrays)."""
    from datasets import Image as ImageFeature
    feature = dataset.features[column]
    if isinstance(feature, ImageFeature) and not feature.decode or _array_feature(feature):
        return dataset
    return dataset.cast_column(column, ImageFeature(decode=False))
