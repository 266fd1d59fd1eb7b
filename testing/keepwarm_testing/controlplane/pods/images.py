"""What the pod runner knows of an image without pulling it: entrypoint, cmd, user, working dir.

The content is always this host's installed keepwarm; the config comes from the Dockerfile stage
that builds the image (`from_dockerfile`), so a pod whose container gives only `args` (the chart's
operator) or no runAsUser (runtime pods run as the image's USER) starts as it would from the image.
An image the runner was not told about has no entrypoint (a container must give `command`) and runs
as root, as an image without USER does.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class ImageConfig:
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    uid: int = 0
    gid: int = 0
    working_dir: str = "/"


def repository(image: str) -> str:
    """The image reference without tag or digest: ghcr.io/x/y:1.0 -> ghcr.io/x/y."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return name[: len(name) - len(last)] + last.split(":", 1)[0]


def _exec_form(value: str) -> list[str]:
    value = value.strip()
    return json.loads(value) if value.startswith("[") else ["/bin/sh", "-c", value]


def from_dockerfile(dockerfile: Path, target: str) -> ImageConfig:
    """ENTRYPOINT, CMD, USER (numeric uid[:gid]) and WORKDIR of stage `target`."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    config: dict[str, object] = {}
    inside = False
    for line in text.splitlines():
        words = line.strip().split(None, 1)
        if not words or words[0].startswith("#"):
            continue
        keyword, rest = words[0].upper(), (words[1] if len(words) > 1 else "")
        if keyword == "FROM":
            inside = rest.split()[-1] == target if " AS " in rest.upper() else False
        elif inside and keyword == "ENTRYPOINT":
            config["entrypoint"] = _exec_form(rest)
        elif inside and keyword == "CMD":
            config["cmd"] = _exec_form(rest)
        elif inside and keyword == "USER":
            uid, _, gid = rest.strip().partition(":")
            config["uid"], config["gid"] = int(uid), int(gid or uid)
        elif inside and keyword == "WORKDIR":
            config["working_dir"] = rest.strip()
    if not config:
        raise ValueError(f"{dockerfile}: no stage {target!r} (or it sets no ENTRYPOINT/CMD/USER/WORKDIR)")
    return ImageConfig(**config)  # type: ignore[arg-type]
