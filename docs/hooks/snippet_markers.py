"""Fail a strict build on a snippet include that did not resolve.

pymdownx.snippets (``check_paths: true``) already stops the build on a missing file or section.
What it cannot see is a marker it does not recognise, such as one a formatter has mangled
(``--8 < --"file"``): that would be shown to readers as text. This hook warns on any snippet
marker left in a page's source or in its rendered text, and ``mkdocs build --strict`` turns the
warning into a failed build.
"""

from __future__ import annotations

import html
import logging
import re

log = logging.getLogger("mkdocs.hooks.snippet_markers")

# Anything that looks like a snippet include, with or without stray spaces. Section markers in
# the source (``# --8<-- [start:f3]``) are followed by a bracket, not a path, and may be shown.
LOOSE = re.compile(r"-{1,}\s*8\s*<\s*-{1,}\s*[\"']")
# The block form pymdownx.snippets resolves: the marker alone on its line, then a quoted path.
RESOLVABLE = re.compile(r'^\s*-{1,}8<-{1,}\s+"[^"\n]+"\s*$')
TAG = re.compile(r"<[^>]+>")


def leftover_markers(markdown: str) -> list[str]:
    """Lines of ``markdown`` that look like snippet markers but are not a resolvable include."""
    return [
        line.strip()
        for line in markdown.splitlines()
        if LOOSE.search(line) and not RESOLVABLE.match(line)
    ]


def on_page_markdown(markdown: str, *, page, config, files) -> str:
    for line in leftover_markers(markdown):
        log.warning("%s: unresolved snippet marker: %s", page.file.src_uri, line)
    return markdown


def on_page_content(content: str, *, page, config, files) -> str:
    text = html.unescape(TAG.sub("", content))
    for match in LOOSE.finditer(text):
        context = text[match.start() : match.start() + 60].splitlines()[0]
        log.warning("%s: snippet marker left in the rendered page: %s", page.file.src_uri, context)
    return content
