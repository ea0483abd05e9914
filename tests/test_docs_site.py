"""The built site: the strict build passes and fails where it must, it asks nothing of the
network, and in a real browser (headless Chromium, when installed) the math renders offline."""

import html
import os
import re
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("mkdocs", reason="the docs extra is not installed")
yaml = pytest.importorskip("yaml")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCREENSHOTS = os.path.join(ROOT, "build", "docs-check")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# The build needs nothing beyond the environment `make` installs: no npm, no Node.js (the PATH
# holds only the interpreter's folder).
ENV = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PATH": os.path.dirname(sys.executable)}


def mkdocs_build(config: str, site: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", config, "-d", site],
        capture_output=True,
        text=True,
        env=ENV,
        check=False,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site built strictly from this checkout, in a temporary folder."""
    folder = str(tmp_path_factory.mktemp("site"))
    build = mkdocs_build(os.path.join(ROOT, "mkdocs.yml"), folder)
    assert build.returncode == 0, build.stderr
    return folder


def page(site, name):
    with open(os.path.join(site, name, "index.html")) as fh:
        return fh.read()


def test_every_nav_page_is_built(site):
    with open(os.path.join(ROOT, "mkdocs.yml")) as fh:
        nav = yaml.safe_load(fh)["nav"]

    def sources(entries):
        for entry in entries:
            value = next(iter(entry.values())) if isinstance(entry, dict) else entry
            yield from sources(value) if isinstance(value, list) else [value]

    for source in sources(nav):
        built = os.path.join(site, source.removesuffix(".md").removesuffix("index"), "index.html")
        assert os.path.isfile(built.replace("/index/", "/")), f"{source} was not built"


def test_math_is_left_for_the_bundled_katex(site):
    fpa = page(site, "fpa")
    assert fpa.count('class="arithmatex"') >= 11 + 4  # F1-F7, G1-G4 and the inline math
    assert "\\tag{F1}" in fpa
    for asset in ("katex.min.js", "katex.min.css", "fonts/KaTeX_Main-Regular.woff2"):
        assert os.path.isfile(os.path.join(site, "assets", "katex", asset)), asset
    assert '<script src="../assets/katex/katex.min.js"' in fpa


def test_performance_page_shows_the_results_as_written(site):
    """One title; bench/RESULTS.md's lines render as its tables and paragraphs (a line starting
    with '>' would be a quotation); the tables sit in the narrow-cell wrapper of attnspec.css."""
    performance = page(site, "performance")
    assert performance.count("<h1") == 1
    assert "<blockquote" not in performance
    body = performance.split('<div class="bench">', 1)[1]
    assert body.count("<table>") >= 2
    assert "Benchmark results" not in performance


def test_the_vendored_katex_is_checked_file_by_file(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "docs", "hooks"))
    try:
        import katex
    finally:
        sys.path.pop(0)
    assert katex.check_vendored() == []
    copy = tmp_path / "katex"
    shutil.copytree(katex.VENDORED, copy)
    with open(copy / "katex.min.js", "ab") as fh:
        fh.write(b";")
    (copy / "fonts" / "KaTeX_Main-Regular.woff2").unlink()
    (copy / "extra.js").write_text("")
    assert katex.check_vendored(str(copy)) == [
        "fonts/KaTeX_Main-Regular.woff2 is missing",
        "katex.min.js differs from the release (sha256)",
        "extra.js is not part of the release",
    ]
    (copy / "SHA256SUMS").write_text("")
    assert "expected sha256" in katex.check_vendored(str(copy))[0]


def test_pages_load_nothing_from_the_network(site):
    """No stylesheet, script, font or image from outside the site, on any page."""
    external = re.compile(r'<(?:script|link|img|source)\b[^>]*\b(?:src|href)="(?:https?:)?//')
    for folder, _, names in os.walk(site):
        for name in names:
            if name.endswith(".html"):
                with open(os.path.join(folder, name)) as fh:
                    text = fh.read()
                assert not external.search(text), f"{name}: {external.search(text).group(0)}"
                assert "fonts.googleapis" not in text and "fonts.gstatic" not in text


def test_code_beside_the_equations_comes_from_the_source(site):
    text = html.unescape(re.sub(r"<[^>]+>", "", page(site, "fpa")))
    assert "return np.maximum(0.0, level[..., None, :] - m)  # (F2)" in text
    conformance = html.unescape(re.sub(r"<[^>]+>", "", page(site, "conformance")))
    assert "class MinimalFoX:" in conformance


def test_api_pages_render_the_docstrings(site):
    reference = page(site, "api/reference")
    assert "attnspec.reference.fpa.fpa_attention" in reference
    assert "First Passage Attention, (F1)-(F5)." in reference
    assert "Source code in <code>reference/fpa.py</code>" in reference
    assert "build/api" not in reference
    for backend in ("torch", "jax"):
        assert f"attnspec.backends.{backend}" in page(site, f"api/{backend}")


def _small_site(tmp_path, body: str) -> subprocess.CompletedProcess:
    """Build a one-page site with the project's Markdown setup and snippet hook."""
    with open(os.path.join(ROOT, "mkdocs.yml")) as fh:
        config = yaml.safe_load(fh)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text(body)
    extensions = [
        {"pymdownx.snippets": {**entry["pymdownx.snippets"], "base_path": [ROOT]}}
        if isinstance(entry, dict) and "pymdownx.snippets" in entry
        else entry
        for entry in config["markdown_extensions"]
    ]
    small = {
        "site_name": "check",
        "docs_dir": str(tmp_path / "docs"),
        "markdown_extensions": extensions,
        "hooks": [os.path.join(ROOT, "docs", "hooks", "snippet_markers.py")],
    }
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(small))
    return mkdocs_build(str(tmp_path / "mkdocs.yml"), str(tmp_path / "site"))


def test_small_site_with_a_good_include_builds(tmp_path):
    build = _small_site(tmp_path, '```python\n--8<-- "reference/fpa.py:f2"\n```\n')
    assert build.returncode == 0, build.stderr


@pytest.mark.parametrize(
    "include, message",
    [
        ('--8 < --"reference/fpa.py:f2"', "unresolved snippet marker"),
        ('--8<-- "reference/fpa.py:no-such-section"', "could not be located"),
        ('--8<-- "reference/no_such_file.py"', "could not be found"),
    ],
)
def test_strict_build_fails_on_an_unresolved_snippet(tmp_path, include, message):
    build = _small_site(tmp_path, f"```python\n{include}\n```\n")
    assert build.returncode != 0
    assert message in build.stderr, build.stderr


# the browser check

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--host-resolver-rules=MAP * ~NOTFOUND",
]


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium)")
@pytest.mark.parametrize("name", ["fpa", "interdomain"])
def test_chromium_renders_the_math_offline(site, name):
    sync_api = pytest.importorskip("playwright.sync_api", reason="the docs extra has playwright")
    root = "file://" + os.path.abspath(site) + "/"
    requested, outside = [], []

    def only_the_site(route):
        url = route.request.url
        requested.append(url)
        if url.startswith(root):
            route.continue_()
        else:
            outside.append(url)
            route.abort()

    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": 1400, "height": 1000})
            context.route("**/*", only_the_site)
            tab = context.new_page()
            tab.goto(root + f"{name}/index.html")
            tab.wait_for_function(
                "document.querySelectorAll('.arithmatex').length > 0 && [...document"
                ".querySelectorAll('.arithmatex')].every(e => e.querySelector('.katex'))",
                timeout=20_000,
            )
            tab.evaluate("document.fonts.ready.then(() => true)")
            state = tab.evaluate(
                """() => ({
                    math: document.querySelectorAll('.arithmatex').length,
                    rendered: document.querySelectorAll('.arithmatex .katex').length,
                    errors: document.querySelectorAll('.katex-error').length,
                    tags: [...document.querySelectorAll('.katex-display .katex-tag')]
                        .map(t => t.textContent),
                    text: document.querySelector('article').innerText,
                    fonts: [...document.fonts].filter(f => f.status === 'loaded')
                        .map(f => f.family),
                })"""
            )
            os.makedirs(SCREENSHOTS, exist_ok=True)
            tab.screenshot(path=os.path.join(SCREENSHOTS, f"{name}.png"))
        finally:
            browser.close()

    assert state["rendered"] == state["math"] > 0
    assert state["errors"] == 0
    prefix = "F" if name == "fpa" else "I"
    assert f"({prefix}1)" in state["tags"] and f"({prefix}5)" in state["tags"], state["tags"]
    for raw in ("\\(", "\\[", "$$", "\\tag", "\\frac", "\\begin"):
        assert raw not in state["text"], f"raw TeX {raw!r} left on the page"
    assert "KaTeX_Main" in state["fonts"], state["fonts"]
    assert outside == [], f"requests outside the site: {outside}"
    assert any(url.endswith("katex.min.js") for url in requested)


def test_the_kit_counts_are_those_of_the_kit(site):
    # Generated at build time by docs/hooks/kit_counts.py (issue 40: the page said 1,115 items
    # and 195 cases while a run had 1,169 and 204).
    from attnspec.conformance.cases import generate_cases
    from attnspec.conformance.numpy_backend import NumpyBackend
    from attnspec.conformance.runner import plan

    cases = generate_cases(None, None)
    items = plan(cases, NumpyBackend().dtypes, finite_differences=True).items
    text = html.unescape(re.sub(r"<[^>]+>", "", page(site, "conformance")))
    assert f"passes all {len(items):,} items ({len(cases):,} cases:" in " ".join(text.split())


def test_spec_equation_blocks_wrap_instead_of_scrolling(site):
    # docs/spec/*.md stay byte-identical to the spec: the hook marks their pages and the
    # stylesheet wraps their code blocks, (F1)-(F7) among them.
    spec = page(site, "spec/fpa")
    assert '<div class="spec-page">' in spec and "(F1) segment minimum" in spec
    with open(os.path.join(site, "assets", "stylesheets", "attnspec.css")) as fh:
        css = " ".join(fh.read().split())
    assert ".md-typeset .spec-page pre > code { white-space: pre-wrap;" in css
