"""Writing shards (`accel-train shard`, commands/shard.py): numbered WebDataset tars and the
index.json that shards.py reads back."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Optional

import numpy as np

from accel_train.data.streaming.shards import IMAGE_EXTS, INDEX_FORMAT, INDEX_NAME


def image_ext(data: bytes, path: Optional[str] = None) -> str:
    if data[:3] == b"\xff\xd8\xff":
        return "jpg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    if data[:3] == b"GIF":
        return "gif"
    if data[:2] == b"BM":
        return "bmp"
    if data[:4] in (b"II*\x00", b"MM\x00*"):
        return "tiff"
    if path and "." in path:
        ext = path.rsplit(".", 1)[-1].lower()
        if ext in IMAGE_EXTS:
            return ext
    return "img"


def png_bytes(pixels: np.ndarray) -> bytes:
    from PIL import Image
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, format="PNG")
    return buffer.getvalue()


class ShardWriter:
    """Writes one split as numbered WebDataset tars, cut at --shard-size bytes or
    --samples-per-shard samples, whichever comes first."""

    def __init__(self, folder: Path, relative_to: Path, max_bytes: Optional[int],
                 max_samples: Optional[int]):
        self.folder, self.root = folder, relative_to
        self.max_bytes, self.max_samples = max_bytes, max_samples
        self.entries: list[dict] = []
        self.tar: Optional[tarfile.TarFile] = None
        self.count = self.size = 0
        self.key = 0

    def _open(self):
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{len(self.entries):06d}.tar"
        self.tar = tarfile.open(path, "w", format=tarfile.USTAR_FORMAT)
        self.entries.append({"file": str(path.relative_to(self.root)), "count": 0})
        self.count = self.size = 0

    def _add(self, name: str, data: bytes):
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = len(data), 0, 0o644
        self.tar.addfile(info, io.BytesIO(data))
        self.size += 512 + (len(data) + 511) // 512 * 512

    def write(self, image: bytes, ext: str, label: int):
        full = self.tar is not None and (
            (self.max_samples and self.count >= self.max_samples)
            or (self.max_bytes and self.size + len(image) + 2048 > self.max_bytes
                and self.count > 0))
        if self.tar is None or full:
            self.close()
            self._open()
        name = f"{self.key:09d}"
        self._add(f"{name}.{ext}", image)
        self._add(f"{name}.cls", str(int(label)).encode())
        self.key += 1
        self.count += 1
        self.entries[-1]["count"] = self.count

    def close(self):
        if self.tar is not None:
            self.tar.close()
            self.tar = None


def write_index(root: Path, splits: dict[str, list[dict]], class_names: list[str],
                source: str) -> Path:
    path = root / INDEX_NAME
    path.write_text(json.dumps({"format": INDEX_FORMAT, "source": source,
                                "class_names": list(class_names),
                                "counts": {name: sum(e["count"] for e in entries)
                                           for name, entries in splits.items()},
                                "splits": splits}, indent=1) + "\n")
    return path
