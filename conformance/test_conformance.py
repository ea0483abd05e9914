"""The conformance suite as pytest items: ``pytest --pyargs attnspec.conformance --backend X``."""

from attnspec.conformance.pytest_plugin import run_item, selected_items


def pytest_generate_tests(metafunc):
    if "conformance_item" in metafunc.fixturenames:
        metafunc.parametrize("conformance_item", selected_items(metafunc.config))


def test_conformance(conformance_item, request):
    run_item(request.config, conformance_item)
