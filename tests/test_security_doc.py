"""docs/security.md names, after each promise, the tests that keep it: every one it names exists, so
a renamed or deleted test cannot leave a promise pointing at nothing."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "security.md").read_text()


def named_tests() -> list[tuple[str, str]]:
    """(test file, test name) for every `test_...` a *Kept by* paragraph names after a test file."""
    found = []
    for paragraph in re.findall(r"\*Kept by:\*(.*?)(?:\n\n|\Z)", DOC, re.S):
        parts = re.split(r"(tests/test_\w+\.py)", paragraph)
        for file, text in zip(parts[1::2], parts[2::2]):
            found += [(file, name) for name in re.findall(r"`(test_\w+)`", text)]
    return found


def test_every_test_the_security_doc_names_exists():
    named = named_tests()
    assert {name for _, name in named} == set(re.findall(r"`(test_\w+)`", DOC))  # each one after its file
    missing = [(file, name) for file, name in named
               if not re.search(rf"^(async )?def {name}\(", (ROOT / file).read_text(), re.M)]
    assert not missing, missing


def test_every_defence_names_its_tests():
    defences = re.findall(r"^\*\*([^*]+)\*\*", DOC.split("## Defences", 1)[1].split("## Not covered", 1)[0], re.M)
    kept = DOC.count("*Kept by:*")
    assert len(defences) >= 10 and kept >= len(defences), (defences, kept)
