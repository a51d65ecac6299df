"""Corpus selection (licenses, split) and the instruction pairs built from it."""

import ast
import json
import random

from training import corpus, pairs

from .conftest import REPO_ROOT


def test_license_filter_keeps_permissive_and_drops_copyleft_or_unknown():
    for ok in ("MIT", "BSD-3-Clause", "Apache-2.0", "PSF-2.0", "MIT OR Apache-2.0", "ISC License (ISCL)"):
        assert corpus.is_permissive(ok), ok
    for bad in ("GPL-3.0", "MPL-2.0", "LGPLv3", "", "UNKNOWN", "Apache-2.0 AND CNRI-Python",
                "public domain, Python, 2-Clause BSD, GPL 3"):
        assert not corpus.is_permissive(bad), bad


def test_heldout_split_is_a_deterministic_small_fraction():
    ids = [f"pkg/mod_{i}.py" for i in range(5000)]
    first = [corpus.split_of(i) for i in ids]
    assert first == [corpus.split_of(i) for i in ids]
    assert 0.01 < first.count("heldout") / len(ids) < 0.03


def test_committed_manifest_lists_only_permissive_sources_with_counts():
    manifest = json.loads((REPO_ROOT / "training" / "corpus_manifest.json").read_text())
    assert manifest["packages"][0]["name"] == "cpython-stdlib"
    for pkg in manifest["packages"]:
        assert corpus.is_permissive(pkg["license"]), pkg
        assert pkg["files"] > 0 and pkg["bytes"] > 0 and pkg["version"]
    assert manifest["totals"]["files"] == sum(p["files"] for p in manifest["packages"])


SOURCE = '''
def clamp(value, low, high):
    """Return value limited to the range [low, high]."""
    if value < low:
        return low
    return min(value, high)

def _private(x):
    """Return x."""
    return x
'''


def test_function_pairs_ask_for_the_function_and_answer_with_its_source():
    got = pairs.function_pairs(SOURCE, random.Random(0))
    assert len(got) == 1
    user, code = got[0]
    assert "returns value limited to the range [low, high]" in user
    assert ast.parse(code).body[0].name == "clamp"
    text = pairs.render(user, code, random.Random(1))
    assert text.endswith("```<|im_end|>\n") and "<|im_start|>assistant\n" in text


def test_hand_written_tasks_parse_and_exclude_the_test_request_verbatim():
    from training.tasks import TASKS

    for task in TASKS:
        ast.parse(task.code)
        assert "Write a Python function that returns the n-th Fibonacci number" not in task.prompts
