// Render the math that pymdownx.arithmatex (generic mode) leaves as \( ... \) and \[ ... \],
// with the KaTeX copy bundled into the site (assets/katex). document$ emits on every page load.
function renderMath(root) {
  for (const element of root.querySelectorAll(".arithmatex")) {
    const source = element.textContent.trim();
    const display = source.startsWith("\\[");
    katex.render(source.slice(2, -2), element, {
      displayMode: display,
      throwOnError: false,
    });
  }
}

document$.subscribe(({ body }) => renderMath(body));
