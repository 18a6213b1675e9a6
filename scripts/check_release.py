"""Check a release's files against its tag before they are published (.github/workflows/release.yml runs it
after ``python -m build``; tests/test_release.py runs it on its own build and on made-up ones).

    python scripts/check_release.py --tag v0.1.0 dist

DIR must hold exactly one sdist and one wheel of cosyllama; the version inside each (the sdist's PKG-INFO, the
wheel's METADATA) must be the tag without its ``v``, and the sdist's CHANGELOG.md must have a dated entry for
it (``## [0.1.0] - 2026-12-05``). Exits 0 and prints the version, or 1 with one line naming what is wrong.
"""

from __future__ import annotations

import argparse
import re
import sys
import tarfile
import zipfile
from email.parser import HeaderParser
from pathlib import Path

NAME = "cosyllama"


class ReleaseError(Exception):
    pass


def _metadata_version(text: str, where: str) -> str:
    version = HeaderParser().parsestr(text).get("Version")
    if not version:
        raise ReleaseError(f"{where} has no Version field")
    return version.strip()


def read_sdist(path: Path) -> tuple[str, str]:
    """(the version in its PKG-INFO, its CHANGELOG.md) of the sdist at ``path``."""
    with tarfile.open(path) as tar:
        names = tar.getnames()
        top = names[0].split("/")[0] if names else ""

        def member(name: str) -> str:
            try:
                f = tar.extractfile(f"{top}/{name}")
            except KeyError:
                f = None
            if f is None:
                raise ReleaseError(f"{path.name} holds no {top}/{name}")
            return f.read().decode("utf-8")

        return _metadata_version(member("PKG-INFO"), f"{path.name}'s PKG-INFO"), member("CHANGELOG.md")


def read_wheel(path: Path) -> str:
    """The version in the METADATA of the wheel at ``path``."""
    with zipfile.ZipFile(path) as whl:
        found = [n for n in whl.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        if len(found) != 1:
            raise ReleaseError(f"{path.name} holds {len(found)} dist-info METADATA files, not one")
        return _metadata_version(whl.read(found[0]).decode("utf-8"), f"{path.name}'s METADATA")


def check(dist: Path, tag: str) -> str:
    """The version of the release in ``dist`` once everything matches ``tag``; else :class:`ReleaseError`."""
    if not dist.is_dir():
        raise ReleaseError(f"{dist} is not a directory")
    files = sorted(p for p in dist.iterdir() if p.is_file())
    sdists = [p for p in files if p.name.endswith(".tar.gz")]
    wheels = [p for p in files if p.suffix == ".whl"]
    others = [p.name for p in files if p not in sdists and p not in wheels]
    if len(sdists) != 1 or len(wheels) != 1 or others:
        names = ", ".join(p.name for p in files) or "nothing"
        raise ReleaseError(f"{dist} must hold one sdist and one wheel, it holds {names}")
    if not tag.startswith("v"):
        raise ReleaseError(f"tag {tag!r} does not start with 'v' (release tags are v<version>, e.g. v0.1.0)")
    want = tag[1:]
    sdist_version, changelog = read_sdist(sdists[0])
    wheel_version = read_wheel(wheels[0])
    for name, version in ((sdists[0].name, sdist_version), (wheels[0].name, wheel_version)):
        if version != want:
            raise ReleaseError(f"tag {tag} names version {want}, but {name} is version {version} "
                               "(src/cosyllama/__init__.py's __version__)")
    prefix = f"{NAME}-{want}"
    if not (sdists[0].name == f"{prefix}.tar.gz" and wheels[0].name.startswith(f"{prefix}-")):
        raise ReleaseError(f"the files are not named for {prefix}: {sdists[0].name}, {wheels[0].name}")
    heading = re.search(rf"^## \[{re.escape(want)}\] - (.*)$", changelog, re.MULTILINE)
    if heading is None:
        raise ReleaseError(f"CHANGELOG.md has no entry '## [{want}] - YYYY-MM-DD'")
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", heading.group(1).strip()):
        raise ReleaseError(f"CHANGELOG.md's entry for {want} is not dated ({heading.group(1).strip()!r}): "
                           "give it the release's date, YYYY-MM-DD, in the commit that is tagged")
    return want


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tag", required=True, help="the release's git tag, v<version>")
    p.add_argument("dist", type=Path, help="the directory python -m build wrote")
    args = p.parse_args(argv)
    try:
        version = check(args.dist, args.tag)
    except (ReleaseError, OSError, tarfile.TarError, zipfile.BadZipFile, UnicodeDecodeError) as e:
        print(f"check_release: error: {e}", file=sys.stderr)
        return 1
    print(f"{NAME} {version}: the sdist and the wheel match tag {args.tag}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
