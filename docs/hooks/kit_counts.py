"""Write the kit's case and item counts into docs/conformance.md at build time, and mark the
normative spec pages for the stylesheet.

The counts sit between ``<!-- kit-counts -->`` and ``<!-- /kit-counts -->`` in the page's source;
the build replaces what is there by the counts of the kit it documents (the numpy backend's plan:
its three dtypes, gradients and call-order checks, central differences), so the site never shows
stale numbers. ``python docs/hooks/kit_counts.py`` rewrites the source the same way.

The spec pages (docs/spec/*.md, copies of the project's spec that stay byte-identical) are wrapped
in ``<div class="spec-page">``, inside which attnspec.css wraps the long lines of their
equation blocks, (F1)-(F7), instead of hiding their ends behind a horizontal scroll.
"""

from __future__ import annotations

import os
import re
import sys

MARKED = re.compile(r"(<!-- kit-counts -->)(.*?)(<!-- /kit-counts -->)", re.DOTALL)


def counts() -> dict[str, int]:
    """The numpy backend's full run: cases, items, and items by kind."""
    from attnspec.conformance.cases import generate_cases
    from attnspec.conformance.numpy_backend import NumpyBackend
    from attnspec.conformance.runner import plan

    cases = generate_cases(None, None)
    items = plan(cases, NumpyBackend().dtypes, finite_differences=True).items
    kinds = {
        kind: sum(k == kind for _, _, k in items) for kind in ("call_order", "finite_difference")
    }
    return {"cases": len(cases), "items": len(items), **kinds}


def sentence(n: dict[str, int]) -> str:
    return (
        f"{n['items']:,} items ({n['cases']:,} cases: outputs and gradients in float64, float32 "
        f"and float16, {n['call_order']} call-order checks, plus {n['finite_difference']} "
        "central-difference checks)"
    )


def fill(markdown: str, n: dict[str, int]) -> str:
    return MARKED.sub(lambda m: m[1] + sentence(n) + m[3], markdown)


def on_page_markdown(markdown: str, *, page, config, files) -> str:
    if page.file.src_uri == "conformance.md":
        return fill(markdown, counts())
    return markdown


def on_page_content(content: str, *, page, config, files) -> str:
    if page.file.src_uri.startswith("spec/"):
        return f'<div class="spec-page">{content}</div>'
    return content


if __name__ == "__main__":
    path = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conformance.md"
    )
    with open(path) as fh:
        text = fh.read()
    with open(path, "w") as fh:
        fh.write(fill(text, counts()))
    sys.exit(0)
