"""`keepwarm serve` flags the operator puts on runtime pods: one home for their names.

The runtime declares its settings in `keepwarm_runtime.server.settings.ServeSettings`, which the
operator cannot import (no torch in its image); every flag is ``settings.flag_name`` of a field name
there, so this module derives them by the same rule. A unit test parses a rendered command with the
runtime's own parser, so a renamed setting fails it rather than a pod.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from .settings import flag_name

ENABLE_LORA = flag_name("enable_lora")  # --enable-lora: serve LoRA adapters
MAX_LORAS = flag_name("max_loras")  # --max-loras: adapter slots, most distinct adapters in one batch
MAX_LORA_RANK = flag_name("max_lora_rank")  # --max-lora-rank: adapters of a higher rank are refused
LORA_MODULES_FILE = flag_name("lora_modules_file")  # --lora-modules-file: the adapters, re-read on change
ALLOW_RUNTIME_LORA_UPDATING = flag_name("allow_runtime_lora_updating")  # /v1/(un)load_lora_adapter
TENSOR_PARALLEL_SIZE = flag_name("tensor_parallel_size")  # --tensor-parallel-size: ranks, one process each
ENABLE_EXPERT_PARALLEL = flag_name("enable_expert_parallel")  # --enable-expert-parallel: experts partitioned
NNODES = flag_name("nnodes")  # --nnodes: pods a group of ranks spans (a LeaderWorkerSet's size)
NODE_RANK = flag_name("node_rank")  # --node-rank: this pod's place in the group (0: the leader, serving)
MASTER_ADDR = flag_name("master_addr")  # --master-addr: the leader pod's address, where the ranks meet
HEADLESS = flag_name("headless")  # --headless: a worker pod of the group, serving no API
SNAPSHOT_STORE = flag_name("snapshot_store")  # --snapshot-store: restore the parent from the node's store
RESTORE_TIMEOUT = flag_name("restore_timeout")  # --restore-timeout: seconds before importing instead
WORKER_LOAD_TIMEOUT = flag_name("worker_load_timeout")  # --worker-load-timeout: a load this long is a hang


def lora_modules_file(adapters: Mapping[str, str]) -> str:
    """A ``--lora-modules-file``'s text from adapter name -> directory: a JSON list of vLLM's JSON form
    of ``--lora-modules``, one object per adapter (the runtime's ``parse_lora_modules_file`` reads it
    back)."""
    return json.dumps([{"name": name, "path": path} for name, path in adapters.items()], indent=1) + "\n"
