"""Check the vendored KaTeX before it goes into the site, so math renders with no network.

The release files of the pinned npm package ``katex`` (the stylesheet, the script, the fonts and
the license) are committed under ``docs/assets/katex/`` and copied into the site as any other
page asset: the build needs neither npm nor the network. ``docs/assets/katex/SHA256SUMS`` lists
the SHA-256 of every one of them (``sha256sum -c SHA256SUMS`` checks them by hand), and this
hook pins the SHA-256 of that list, so a build fails when a file was changed, removed or added.

To move to another release, update ``KATEX_VERSION`` and ``KATEX_INTEGRITY`` (``npm view
katex@<version> dist.integrity``), fetch the package once with ``npm pack katex@<version>``, and
run ``python docs/hooks/katex.py katex-<version>.tgz``: it checks the tarball against
``KATEX_INTEGRITY``, replaces the vendored files, writes SHA256SUMS and prints the hash to put
into ``MANIFEST_SHA256``.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import sys
import tarfile
import tempfile

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import Files

KATEX_VERSION = "0.19.1"
# `npm view katex@0.19.1 dist.integrity`: the tarball the vendored files were taken from.
KATEX_INTEGRITY = (
    "sha512-jG8uKntjSEcm2EpQOh0XturpPuuC9r3Sq5HLHdsFdWZT27E672SF19Q"
    "Ei+of0/YeOy15lDgRhKvr5614uRrEfA=="
)
# `sha256sum docs/assets/katex/SHA256SUMS`
MANIFEST_SHA256 = "f630c436a956f1879baf069c01225cdfcedfbc9e24f8a56677f2910138137c9f"
# What the site needs from the package: paths inside its tarball, under package/.
ASSETS = ("dist/katex.min.js", "dist/katex.min.css", "dist/fonts/", "LICENSE")
SITE_FOLDER = "assets/katex"
MANIFEST = "SHA256SUMS"
HERE = os.path.dirname(os.path.abspath(__file__))
VENDORED = os.path.join(os.path.dirname(HERE), *SITE_FOLDER.split("/"))


def _digest(path: str, algorithm: str) -> bytes:
    digest = hashlib.new(algorithm)
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.digest()


def integrity(path: str) -> str:
    """The Subresource Integrity string (sha512, base64) of a file, as npm records it."""
    return "sha512-" + base64.b64encode(_digest(path, "sha512")).decode()


def _files(folder: str) -> list[str]:
    """The files under ``folder``, as sorted relative paths with forward slashes."""
    found = []
    for directory, _, names in os.walk(folder):
        for name in names:
            found.append(os.path.relpath(os.path.join(directory, name), folder))
    return sorted(path.replace(os.sep, "/") for path in found)


def check_vendored(folder: str = VENDORED) -> list[str]:
    """Every problem with the vendored copy in ``folder`` (empty when it is the pinned release):
    a manifest other than the pinned one, a listed file missing or changed, a file not listed."""
    manifest = os.path.join(folder, MANIFEST)
    if not os.path.isfile(manifest):
        return [f"{manifest} is missing"]
    found = _digest(manifest, "sha256").hex()
    if found != MANIFEST_SHA256:
        return [f"{manifest}: expected sha256 {MANIFEST_SHA256}, got {found}"]
    problems, listed = [], set()
    with open(manifest) as fh:
        for line in fh:
            digest, _, name = line.rstrip("\n").partition("  ")
            listed.add(name)
            path = os.path.join(folder, *name.split("/"))
            if not os.path.isfile(path):
                problems.append(f"{name} is missing")
            elif _digest(path, "sha256").hex() != digest:
                problems.append(f"{name} differs from the release (sha256)")
    unlisted = [name for name in _files(folder) if name not in listed | {MANIFEST}]
    return problems + [f"{name} is not part of the release" for name in unlisted]


def on_files(files: Files, *, config: MkDocsConfig) -> Files:
    problems = check_vendored()
    if problems:
        raise PluginError(
            f"katex: the vendored katex@{KATEX_VERSION} in docs/{SITE_FOLDER}/ is not the "
            f"pinned release: {'; '.join(problems)} (restore it with git, or refresh it: "
            "python docs/hooks/katex.py katex-<version>.tgz)"
        )
    manifest = files.get_file_from_path(f"{SITE_FOLDER}/{MANIFEST}")
    if manifest is not None:
        files.remove(manifest)  # the list is for the check, not for readers
    return files


def vendor(tarball: str, folder: str = VENDORED) -> str:
    """Replace the vendored files by the release in ``tarball`` (checked against
    ``KATEX_INTEGRITY``); write the manifest and return its SHA-256."""
    found = integrity(tarball)
    if found != KATEX_INTEGRITY:
        raise ValueError(f"{tarball}: expected integrity {KATEX_INTEGRITY}, got {found}")
    with tempfile.TemporaryDirectory() as staging:
        with tarfile.open(tarball, "r:gz") as archive:
            members = [
                m
                for m in archive.getmembers()
                if m.isfile() and m.name.removeprefix("package/").startswith(ASSETS)
            ]
            archive.extractall(staging, members=members, filter="data")
        shutil.rmtree(folder, ignore_errors=True)
        package = os.path.join(staging, "package")
        shutil.copytree(os.path.join(package, "dist"), folder)
        shutil.copy(os.path.join(package, "LICENSE"), folder)
    lines = [f"{_digest(os.path.join(folder, n), 'sha256').hex()}  {n}\n" for n in _files(folder)]
    with open(os.path.join(folder, MANIFEST), "w") as fh:
        fh.writelines(lines)
    return _digest(os.path.join(folder, MANIFEST), "sha256").hex()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python docs/hooks/katex.py katex-<version>.tgz")
    print(f'MANIFEST_SHA256 = "{vendor(sys.argv[1])}"')
