"""modelgen's one setting: where trained tokenizers are kept (``KEEPWARM_CACHE_HOME``).

modelgen's builders are called as a library (tests, benchmarks, the demo; `keepwarm make-model` declares
no settings), so no entry point resolves settings for them; like cache/env.py for ``attach()``'s
callers, this module reads its variable by the settings layer's one rule
(``keepwarm_api.settings.present``: unset or empty means the default), and the tokenizer takes the
folder as an argument.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from keepwarm_api.settings import env_name, present

CACHE_HOME_ENV = env_name("cache_home")  # KEEPWARM_CACHE_HOME


def cache_home(environ: Mapping[str, str] = os.environ) -> Path:
    """``KEEPWARM_CACHE_HOME``, else ``~/.cache/keepwarm``."""
    return Path(present(environ.get(CACHE_HOME_ENV)) or Path.home() / ".cache" / "keepwarm")
