"""What the central site and the factories share.

Importing this package turns gRPC's fork handlers off for the process, unless the environment already sets
``GRPC_ENABLE_FORK_SUPPORT``. `common.procs` starts every child with a ``preexec_fn``, which makes Python use
fork() rather than vfork(); with gRPC live in the parent, gRPC's post-fork handler restarts its poller thread in
the child, the child then closes inherited descriptors before exec, and the poller aborts on EBADF: the child dies
with SIGABRT before it runs (grpc/grpc#43055, grpcio >= 1.80; seen once as a factory that "exited with -6 during
start-up"). No FedForge process relies on gRPC across fork: DDP workers are spawned, and the warm ClientApp server
forks before it opens any channel. gRPC reads the setting when it is imported, so it is set here, in the package
every ``fedforge`` entry point and ``tests/conftest.py`` import first.
"""

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
