"""Issue 14: the output rail on replies that follow a long pasted text (docs/moderation.md, "Replies after long
pastes"). The check is output test set B (held out) with 1.5K or 3K characters of documentation from the test split
pasted before each user message (tools/check_output_rail_long_pastes.py, part 2); the shipped probes' accuracy on it
(float and int4) is a benchmark: ``python -m benchmarks.guard_sets --set output-pastes``. Here: that its pastes stay
apart from the tuning set's."""

import pydoc_data.topics as topics

from flashguard.rails.lab.calibrate import TUNING_SET, read_rows
from tests.rail_sets import OUTPUT_SETS, output_set_after_pastes, paste_tools


def test_the_pastes_come_from_the_test_split_and_no_tuning_row_holds_them():
    _, M = paste_tools()
    test_b = read_rows(OUTPUT_SETS["B"])
    rows = output_set_after_pastes()
    assert len(rows) == len(test_b) and all(len(r["user"]) > 1200 + len(t["user"]) for r, t in zip(rows, test_b))
    tune = read_rows(TUNING_SET)
    pasted = [r for r in tune if "paste" in r]
    assert len(pasted) >= 200 and {r["bot"] for r in pasted} <= {r["bot"] for r in tune if "paste" not in r}
    # the tuning pastes use no documentation topic of the test split (the check's source)
    test_topics = [topics.topics[k].strip()[:200] for k in M.TEST_DOC_KEYS if len(topics.topics[k].strip()) > 300]
    assert not [t for t in test_topics if any(t in r["user"] for r in pasted)]
    assert not [r for r in pasted if "Here is something I was reading" in r["user"]]
