"""The model card's command line: what a reader of the card can type, from what the run recorded
(the end-to-end card is checked in test_export_formats.py)."""

import shlex

import pytest

from accel_train.model.model_card import shown_command


@pytest.mark.parametrize("recorded, shown", [
    # python -m accel_train: python records the module's file as argv[0]
    (["/opt/venv/lib/python3.11/site-packages/accel_train/__main__.py", "--epochs", "3"],
     "accel-train --epochs 3"),
    (["/home/u/.local/bin/accel-train", "--data-dir", "my data"],
     "accel-train --data-dir 'my data'"),
    # a user's program (fit()) stays itself, as typed, run by python
    (["examples/custom_model.py", "--epochs", "2"], "python examples/custom_model.py --epochs 2"),
    # another package's __main__.py is not ours
    (["/srv/tool/__main__.py", "-x"], "python /srv/tool/__main__.py -x"),
    ([], ""),
])
def test_the_cards_command_is_one_a_reader_can_type(recorded, shown):
    assert shlex.join(shown_command(recorded)) == shown
