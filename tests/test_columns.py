"""Tables of file and class names in terminal columns: CJK characters take two, combining
accents none (oracle: the widths counted by hand, and wcwidth's rules as terminals apply them)."""

from accel_train.base.columns import display_width, pad
from accel_train.train.evaluate import format_results


def test_widths_counted_as_a_terminal_shows_them():
    assert display_width("cat.jpg") == 7
    assert display_width("日本.jpg") == 8          # two wide characters, then four
    assert display_width("ＡＢ") == 4              # fullwidth Latin letters: two columns each
    assert display_width("e\u0301t\u00e9") == 3   # decomposed é (two code points) and composed
    assert pad("日本", 5) == "日本 " and pad("toolong", 3) == "toolong"


def test_the_per_class_table_lines_up_names_of_any_script():
    results = {"loss": 0.5, "top1": 0.5, "top5": 1.0, "mean_class_top1": 0.5, "count": 4,
               "per_class": {"correct": [1, 1], "total": [2, 2], "predicted": [2, 2],
                             "mistaken_for": [(1, 1), (0, 1)]}}
    lines = format_results(results, ["猫", "cat"]).splitlines()[2:]
    # the 'correct' column ends at the same terminal column in every row
    ends = [display_width(line[:line.index(word) + len(word)])
            for line, word in zip(lines, ("correct", "1", "1"))]
    assert len(set(ends)) == 1, lines
