"""kopf handlers. Importing this package registers them; `keepwarm-operator run` does that.

Handlers are level-based: every trigger (create, update, resume, timer, child event) runs the same
reconcile, which recomputes desired state, server-side applies what changed (applied.py) and rewrites
status. The modules do not import each other: each handles the kopf events it needs (inference.py
those of WeightCaches and WeightCacheNodes too) and shares only setup's Context.
"""

from ..settings import OperatorSettings
from . import inference, nodes, setup, weightcache

__all__ = ["inference", "nodes", "register", "setup", "weightcache"]


def register(settings: OperatorSettings) -> None:
    """Register the handlers whose policy comes from settings (call once, before kopf runs)."""
    weightcache.register_resync(settings.resync_seconds)
    inference.register_resync(settings.resync_seconds)
