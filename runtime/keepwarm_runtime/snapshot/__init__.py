"""Process snapshots of `keepwarm serve`'s supervising parent (docs/snapshots.md).

The parent imports the whole serving path before it binds or forks (server/preload.py): seconds of
Python that every new pod pays. A node-local snapshot of that prepared parent, taken with CRIU by the
node agent and restored by a new pod's `keepwarm serve`, skips them. One module per idea:

* ``key``: what makes restored memory right for this start (packages, interpreter, model, CPU, ...);
* ``store``: the node's snapshot directory: manifests, digests, atomic installs, budget and LRU;
* ``criu``: the CRIU command lines and their runs;
* ``wire``: the messages between a snapshot's parent, the agent and the launcher (ready, context);
* ``fresh``: what a restored parent takes afresh (environment, per-pod facts, every random state);
* ``restore``: `keepwarm serve`'s launcher: find, check and restore a snapshot, then stay as init;
* ``take`` and ``service``: the node agent's side: one snapshot taken, and the socket service that
  takes them on request (single-flight per key);
* ``client``: a runtime pod asking for a snapshot, or reporting a restore.

The process that is checkpointed is the server's own parent, so it lives with the server:
server/checkpoint.py (preload, then the checkpoint point, then resume as `keepwarm serve`).

Anything that goes wrong falls back to importing, as without snapshots, named and counted.
"""
