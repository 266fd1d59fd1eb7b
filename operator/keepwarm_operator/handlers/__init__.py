"""kopf handlers. Importing this package registers them; `keepwarm-operator run` does that.

Handlers are level-based: every trigger (create, update, resume, timer, child event) runs the same
reconcile, which recomputes desired state, server-side applies it and rewrites status.
"""

from . import inference, nodes, setup, weightcache

__all__ = ["inference", "nodes", "setup", "weightcache"]
