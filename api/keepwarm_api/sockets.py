"""The node cache's socket names and the limit on their paths.

One home for the daemon (which binds them), its clients (which look them up) and the WeightCache
CRD (whose rule keeps `<socket.directory>/<cache name>/<longest socket name>` bindable). AF_UNIX
takes at most 107 bytes of path, and a GPU daemon's socket is named after the GPU's UUID, so on the
gpu tier a long directory plus a long cache name would only fail when the agent binds.
"""

from __future__ import annotations

HOST_SOCKET = "host.sock"  # the host tier's daemon
# The node agent's snapshot service (keepwarm_runtime.snapshot.service), beside the daemons' sockets.
SNAPSHOT_SOCKET = "snapshot.sock"
# sun_path in struct sockaddr_un is 108 bytes on Linux, one of them the terminating NUL.
MAX_SOCKET_PATH_BYTES = 107
GPU_UUID_LENGTH = len("GPU-") + 36  # as nvidia-smi -L and NVML print it: GPU-<UUID>


def gpu_socket_name(gpu_uuid: str) -> str:
    """The socket of the daemon serving one GPU."""
    return f"gpu-{gpu_uuid}.sock"


LONGEST_SOCKET_NAME = len(gpu_socket_name("G" * GPU_UUID_LENGTH))
# The longest socket directory (`<socket.directory>/<cache name>`) every GPU's socket fits under.
MAX_GPU_SOCKET_DIR = MAX_SOCKET_PATH_BYTES - 1 - LONGEST_SOCKET_NAME
