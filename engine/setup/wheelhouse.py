"""Export every wheel an environment uses to one folder, so that it can be rebuilt with no network.

A wheel is taken from a folder that already holds it (``search`` folders, such as a previous wheelhouse) when one
with the same name and version is there; otherwise it is rebuilt from the installed files, which the
distribution's RECORD lists: that works offline and keeps exactly the build that is installed (a cu128 torch
stays cu128). Scripts that the installer generated from entry points are left out (they are generated again);
other scripts get the ``#!python`` line wheels use. Editable installs (a developer checkout) cannot be exported
and are reported. The folder also gets ``requirements.txt`` pinning every exported version.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import re
import shutil
import sys
import sysconfig
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from engine.setup.cancel import CancelToken
from engine.setup.events import Progress, SetupCancelled, SetupEvent, SetupFinished, SetupWarning, StepStarted

_SKIPPED_METADATA = {"RECORD", "INSTALLER", "REQUESTED", "direct_url.json", "uv_cache.json"}


@dataclass(frozen=True)
class InstalledDistribution:
    name: str  # as in the .dist-info folder name, e.g. PySide6_Essentials
    version: str
    dist: metadata.Distribution

    @property
    def key(self) -> str:
        return normalize(self.name)

    @property
    def editable(self) -> bool:
        text = self.dist.read_text("direct_url.json")
        return bool(text and json.loads(text).get("dir_info", {}).get("editable"))


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def installed_distributions(site_packages: Iterable[Path] | None = None) -> list[InstalledDistribution]:
    """The distributions installed in ``site_packages`` (default: this interpreter's), one per name."""
    paths = [str(p) for p in site_packages] if site_packages is not None else _own_site_packages()
    found: dict[str, InstalledDistribution] = {}
    for dist in metadata.distributions(path=paths):
        folder = Path(str(dist._path))  # type: ignore[attr-defined]  # the .dist-info folder
        if folder.suffix != ".dist-info":
            continue
        name, _, version = folder.stem.partition("-")
        found.setdefault(normalize(name), InstalledDistribution(name, version, dist))
    return sorted(found.values(), key=lambda d: d.key)


def _own_site_packages() -> list[str]:
    return sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")})


def find_wheel(folders: Iterable[Path], dist: InstalledDistribution) -> Path | None:
    for folder in folders:
        for wheel in sorted(Path(folder).glob("*.whl")):
            name, version = wheel.name.split("-")[:2]
            if normalize(name) == dist.key and version == dist.version:
                return wheel
    return None


def wheel_tags(dist: metadata.Distribution) -> str:
    """The compressed tag set of the wheel the distribution came from, e.g. ``py2.py3-none-any``."""
    tags = [
        line.split(":", 1)[1].strip()
        for line in (dist.read_text("WHEEL") or "").splitlines()
        if line.startswith("Tag:")
    ]
    if not tags:
        return "py3-none-any"
    parts = [tag.split("-") for tag in tags]
    return "-".join(".".join(dict.fromkeys(p[i] for p in parts)) for i in range(3))


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _entry_point_scripts(dist: metadata.Distribution) -> set[str]:
    return {ep.name.lower() for ep in dist.entry_points if ep.group in ("console_scripts", "gui_scripts")}


def _archive_name(dist: InstalledDistribution, installed: Path, prefix: Path, dist_info: str) -> str | None:
    """Where an installed file goes inside the wheel, or None to leave it out."""
    site = Path(str(dist.dist.locate_file(""))).resolve()
    if installed.is_relative_to(site):
        relative = installed.relative_to(site).as_posix()
        if "__pycache__" in relative or relative.endswith(".pyc"):
            return None
        if relative.startswith(dist_info + "/") and relative.split("/", 1)[1] in _SKIPPED_METADATA:
            return None
        return relative
    data = f"{dist.name}-{dist.version}.data"
    scripts = Path(sysconfig.get_path("scripts", vars={"base": str(prefix), "platbase": str(prefix)}))
    if installed.is_relative_to(scripts):
        stem = installed.name.lower().removesuffix(".exe").removesuffix("-script.py")
        if stem in _entry_point_scripts(dist.dist):
            return None
        return f"{data}/scripts/{installed.relative_to(scripts).as_posix()}"
    if installed.is_relative_to(prefix):
        return f"{data}/data/{installed.relative_to(prefix).as_posix()}"
    return None


def repack(dist: InstalledDistribution, destination: Path, prefix: Path | None = None) -> Path:
    """Rebuild the wheel of an installed distribution from its files into ``destination``."""
    prefix = (prefix or Path(sys.prefix)).resolve()
    dist_info = f"{dist.name}-{dist.version}.dist-info"
    target = destination / f"{dist.name}-{dist.version}-{wheel_tags(dist.dist)}.whl"
    partial = target.with_suffix(".partial")
    records: list[tuple[str, str, str]] = []
    with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as archive:
        for file in dist.dist.files or ():
            installed = Path(str(dist.dist.locate_file(file))).resolve()
            name = _archive_name(dist, installed, prefix, dist_info)
            if name is None or not installed.is_file():
                continue
            data = installed.read_bytes()
            if "/scripts/" in name and data.startswith(b"#!"):
                data = b"#!python" + data[data.index(b"\n") :] if b"\n" in data else b"#!python\n"
            info = zipfile.ZipInfo(name, date_time=(2000, 1, 1, 0, 0, 0))
            info.external_attr = (installed.stat().st_mode & 0xFFFF) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, data, compresslevel=1)
            records.append((name, _record_hash(data), str(len(data))))
        out = io.StringIO()
        csv.writer(out, lineterminator="\n").writerows([*records, (f"{dist_info}/RECORD", "", "")])
        archive.writestr(f"{dist_info}/RECORD", out.getvalue())
    os.replace(partial, target)
    return target


def export_wheelhouse(
    destination: Path,
    site_packages: Iterable[Path] | None = None,
    search: Iterable[Path] = (),
    prefix: Path | None = None,
    cancel: CancelToken | None = None,
) -> Iterator[SetupEvent]:
    """Write a wheel of every installed distribution to ``destination``, with a ``requirements.txt``."""
    destination.mkdir(parents=True, exist_ok=True)
    search = [Path(p) for p in search]
    dists = installed_distributions(site_packages)
    yield StepStarted(1, 1, f"Exporting {len(dists)} wheels to {destination}")
    pins: list[str] = []
    for done, dist in enumerate(dists, 1):
        if cancel is not None and cancel.cancelled:
            yield SetupCancelled("export stopped; the wheels written so far are complete")
            return
        if dist.editable:
            yield SetupWarning(f"{dist.name} {dist.version} is an editable install and was not exported")
            continue
        existing = find_wheel([*search, destination], dist)
        if existing is None:
            repack(dist, destination, prefix)
        elif existing.parent.resolve() != destination.resolve():
            shutil.copy2(existing, destination / existing.name)
        pins.append(f"{dist.name}=={dist.version}")
        yield Progress(done, len(dists), f"{dist.name} {dist.version}")
    (destination / "requirements.txt").write_text("\n".join(pins) + "\n")
    size = sum(p.stat().st_size for p in destination.glob("*.whl"))
    yield SetupFinished(f"{len(pins)} wheels ({size / 1e9:.2f} GB) in {destination}")
