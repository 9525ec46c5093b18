"""A profile and the profiles it extends, as files that can sit side by side in one folder."""

from __future__ import annotations

import tomllib
from pathlib import Path

from pipeline.deploy.plan import DeployError

TOP = "profile.toml"


def profile_files(path: str | Path) -> dict[str, str]:
    """{file name: text}: the profile itself as `profile.toml`, each profile it extends
    under its own name (`extends` names a file next to the profile, so it still resolves)."""
    files: dict[str, str] = {}
    current: Path | None = Path(path)
    name = TOP
    while current is not None:
        text = current.read_text()
        if name in files:
            raise DeployError(
                f"{current} would be mounted as {name!r} twice; rename one of the profiles"
            )
        files[name] = text
        parent = tomllib.loads(text).get("extends")
        if not parent:
            break
        if "/" in parent or "\\" in parent:
            raise DeployError(
                f"{current} extends {parent!r} in another folder; a mounted profile can only "
                "extend a file next to it: move it beside the profile"
            )
        current, name = current.parent / parent, parent
    return files
