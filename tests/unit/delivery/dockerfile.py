"""A small Dockerfile reader for the image checks: stages, build-argument defaults, users, image refs.

It understands what keepwarm's Dockerfile uses (FROM ... AS, ARG, USER, RUN with line continuations,
COPY --from) and nothing more; `make test` also runs hadolint on the same file.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

# uids the base images already hold: Debian/Ubuntu system accounts (0-999), `nobody` (65534), and
# the `ubuntu` user (1000) that Ubuntu 23.04+ images (so nvidia/cuda:*-ubuntu24.04) ship.
BASE_IMAGE_UIDS = {"ubuntu": set(range(1000)) | {1000, 65534}, "debian": set(range(1000)) | {65534}}


@dataclass
class Stage:
    name: str
    base: str  # the FROM image with build arguments substituted
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (KEYWORD, rest of the line)

    def all(self, keyword: str) -> list[str]:
        return [rest for kw, rest in self.instructions if kw == keyword]


@dataclass
class Dockerfile:
    args: dict[str, str]  # global ARG defaults, substituted in order
    stages: dict[str, Stage]


def logical_lines(text: str) -> list[str]:
    """Join backslash continuations and drop comments, as the Dockerfile parser does."""
    lines, current = [], ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") or not stripped:
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(current + stripped)
        current = ""
    return lines


def substitute(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)), value)


def parse(text: str) -> Dockerfile:
    args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    stage: Stage | None = None
    for line in logical_lines(text):
        keyword, _, rest = line.partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword == "ARG" and stage is None:
            name, _, default = rest.partition("=")
            args[name] = substitute(default.strip('"'), args)
        elif keyword == "FROM":
            parts = rest.split()
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else f"stage{len(stages)}"
            stage = stages[name] = Stage(name, substitute(parts[0], args))
        elif stage is not None:
            stage.instructions.append((keyword, rest))
    return Dockerfile(args, stages)


def created_uids(stage: Stage) -> dict[str, int]:
    """User name -> uid for every `useradd --uid N NAME` in the stage's RUN lines."""
    users = {}
    for run in stage.all("RUN"):
        for command in re.split(r"&&|;", run):
            if command.split()[:1] != ["useradd"]:
                continue  # other commands may hold quoted code that a split on `;` cut in two
            words = shlex.split(command)
            uid = next((int(words[i + 1]) for i, w in enumerate(words) if w in ("--uid", "-u")), None)
            if uid is not None:
                users[words[-1]] = uid
    return users


def runtime_uid(stage: Stage, users: dict[str, int]) -> int | None:
    """The uid the image runs as: the last USER, numeric or a name created in the stage."""
    user_lines = stage.all("USER")
    if not user_lines:
        return None
    user = user_lines[-1].split(":")[0]
    return int(user) if user.isdigit() else users.get(user)


def base_family(image: str) -> str:
    return "ubuntu" if "ubuntu" in image else "debian"


def user_problems(stage: Stage) -> list[str]:
    """Why this stage's runtime user is root, missing, or collides with a user of its base image."""
    users = created_uids(stage)
    taken = BASE_IMAGE_UIDS[base_family(stage.base)]
    problems = [
        f"useradd {name} --uid {uid}: the base image already has uid {uid}"
        for name, uid in users.items()
        if uid in taken
    ]
    uid = runtime_uid(stage, users)
    if uid is None:
        problems.append(f"stage {stage.name} sets no USER (or an unknown one): it would run as root")
    elif uid == 0:
        problems.append(f"stage {stage.name} runs as root")
    return problems
