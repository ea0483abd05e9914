"""tests/conftest.py's ``SLOW_FIRST`` names tests that exist: a renamed or moved test would fall
back to collection order, and make test would again end with one worker running a long test
while the other idles."""

import pathlib
import re

import conftest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_slow_first_prefix_names_a_test():
    for prefix in conftest.SLOW_FIRST:
        path, _, name = prefix.partition("::")
        source = ROOT / path
        assert source.is_file(), prefix
        if name:
            assert re.search(rf"^def {re.escape(name)}\(", source.read_text(), re.M), prefix
