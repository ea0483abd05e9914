"""The conformance suite as pytest items: ``pytest --pyargs attnspec.conformance --backend X``."""

import pytest

from attnspec.conformance.pytest_plugin import Item, run_item, selected_items


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "conformance_item" in metafunc.fixturenames:
        metafunc.parametrize("conformance_item", selected_items(metafunc.config))


def test_conformance(conformance_item: Item, request: pytest.FixtureRequest) -> None:
    run_item(request.config, conformance_item)
