"""The README is part of the product: it opens with the two commands CI runs, and names every verb."""

import pathlib
import re

from kprof.cli import VERBS

README = (pathlib.Path(__file__).parent.parent / "README.md").read_text()


def test_readme_opens_with_exactly_two_commands():
    first = re.search(r"```bash\n(.*?)```", README, re.S)
    assert first is not None and README.index(first.group(0)) < README.index("\n## ")
    lines = [line for line in first.group(1).splitlines() if line.strip()]
    assert len(lines) == 2
    assert "kprof run" in lines[0] and "pytest" in lines[1]


def test_every_verb_appears_in_the_readme():
    missing = [name for name, _target, _help in VERBS if f"kprof {name}" not in README]
    assert not missing, f"verbs not shown in README.md: {missing}"
