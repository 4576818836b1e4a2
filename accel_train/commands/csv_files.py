"""A CSV file a command writes for people and spreadsheets (predict --csv, eval --mistakes):
its target checked before any work, its rows written to a hidden file beside it and renamed onto
it only when complete, so that a failed or interrupted command leaves an earlier file as it
was."""

from __future__ import annotations

import csv
import os
import tempfile
from pathlib import Path
from typing import Sequence

from accel_train.base.errors import UsageError


def check_csv_target(path: Path, flag: str = "--csv", example: str = "predictions.csv"
                     ) -> None:
    """Before any work: `flag` names a file whose folder exists."""
    if path.is_dir():
        raise UsageError(f"{flag} {path} is a folder; name the file to write ({example})")
    if not path.parent.is_dir():
        raise UsageError(f"{flag} {path}: the folder {path.parent} does not exist; create it "
                         f"or name a file in an existing folder")


class CsvOutput:
    """Rows written to a hidden file beside `path` as they are predicted (a test set of any size
    in constant memory), renamed onto `path` by `commit`; `discard` (or an exception inside
    the `with`) removes it.  `path` is checked before any work (check_csv_target); a folder
    that went away since, or cannot be written, is the refusal here."""

    def __init__(self, path: Path, header: Sequence[str], flag: str = "--csv"):
        self.path = path
        try:
            handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial",
                                           dir=path.parent)
        except OSError as err:
            raise UsageError(f"{flag} {path}: cannot write in {path.parent} "
                             f"({err.strerror}); name a file in a folder you can write") from None
        self._tmp = Path(tmp)
        self._file = os.fdopen(handle, "w", newline="", encoding="utf-8")
        self._writer = csv.writer(self._file)  # quotes a name holding a comma, as readers expect
        self._writer.writerow(header)
        self.rows = 0

    def write(self, row: Sequence[object]) -> None:
        self._writer.writerow(row)
        self.rows += 1

    def commit(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._tmp, self.path)

    def discard(self) -> None:
        self._file.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> "CsvOutput":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if not self._file.closed:  # not committed: an exception or a failed image
            self.discard()
