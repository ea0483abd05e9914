"""Bundle KaTeX into the site so that math renders with no network when the pages are read.

The build takes the pinned npm package ``katex`` (``npm pack``, the registry's own client), checks
its tarball against the pinned Subresource Integrity hash, unpacks the stylesheet, the script and
the fonts into ``build/katex/<version>/`` once, and adds them to the site as ``assets/katex/``.
A tarball placed at ``build/katex/katex-<version>.tgz`` by hand is used as is (after the check),
so a machine without npm can build from a copied tarball.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import tarfile

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

KATEX_VERSION = "0.19.1"
# `npm view katex@0.19.1 dist.integrity`
KATEX_INTEGRITY = (
    "sha512-jG8uKntjSEcm2EpQOh0XturpPuuC9r3Sq5HLHdsFdWZT27E672SF19Q"
    "Ei+of0/YeOy15lDgRhKvr5614uRrEfA=="
)
# What the site needs from the package: paths inside its tarball, under package/.
ASSETS = ("dist/katex.min.js", "dist/katex.min.css", "dist/fonts/", "LICENSE")
SITE_FOLDER = "assets/katex"


def integrity(path: str) -> str:
    """The Subresource Integrity string (sha512, base64) of a file, as npm records it."""
    digest = hashlib.sha512()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return "sha512-" + base64.b64encode(digest.digest()).decode()


def _fetch_tarball(cache: str) -> str:
    tarball = os.path.join(cache, f"katex-{KATEX_VERSION}.tgz")
    if not os.path.isfile(tarball):
        npm = shutil.which("npm")
        if npm is None:
            raise PluginError(
                f"katex: the docs bundle katex@{KATEX_VERSION} from the npm registry and need "
                f"`npm` to fetch it once; install Node.js/npm, or place the tarball at {tarball}"
            )
        os.makedirs(cache, exist_ok=True)
        result = subprocess.run(
            [npm, "pack", f"katex@{KATEX_VERSION}", "--pack-destination", cache, "--silent"],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0 or not os.path.isfile(tarball):
            raise PluginError(
                f"katex: `npm pack katex@{KATEX_VERSION}` failed (exit {result.returncode}): "
                f"{result.stderr.strip()}"
            )
    found = integrity(tarball)
    if found != KATEX_INTEGRITY:
        raise PluginError(
            f"katex: {tarball}: expected integrity {KATEX_INTEGRITY}, got {found}; delete the file "
            "and build again"
        )
    return tarball


def unpacked_katex(root: str) -> str:
    """The folder holding the checked KaTeX assets (``dist/...``, ``LICENSE``); unpack on demand."""
    cache = os.path.join(root, "build", "katex")
    folder = os.path.join(cache, KATEX_VERSION)
    if os.path.isfile(os.path.join(folder, "dist", "katex.min.js")):
        return folder
    tarball = _fetch_tarball(cache)
    staging = folder + ".partial"
    shutil.rmtree(staging, ignore_errors=True)
    with tarfile.open(tarball, "r:gz") as archive:
        members = [
            m
            for m in archive.getmembers()
            if m.isfile() and m.name.removeprefix("package/").startswith(ASSETS)
        ]
        archive.extractall(staging, members=members, filter="data")
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(os.path.join(staging, "package"), folder)
    shutil.rmtree(staging)
    return folder


def on_files(files: Files, *, config) -> Files:
    root = os.path.dirname(os.path.abspath(config.config_file_path))
    folder = unpacked_katex(root)
    for directory, _, names in os.walk(folder):
        for name in sorted(names):
            path = os.path.join(directory, name)
            relative = os.path.relpath(path, folder).replace(os.sep, "/").removeprefix("dist/")
            files.append(File.generated(config, f"{SITE_FOLDER}/{relative}", abs_src_path=path))
    return files
