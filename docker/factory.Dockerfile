# FedForge factory: the warm edge agent (data, DDP/FSDP workers, privacy ledger, Inspection) and Flower's SuperNode.
# compose.yaml runs them as two containers of this image (`fedforge agent` with the images and state, `fedforge
# supernode` with only the agent's socket); `fedforge client` runs both in one.
#   CPU:  docker build -f docker/factory.Dockerfile -t fedforge-factory .
#   CUDA: docker build -f docker/factory.Dockerfile -t fedforge-factory:cuda \
#           --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#           --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM python:3.11-slim-bookworm AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
WORKDIR /src
RUN pip install --no-cache-dir --upgrade pip wheel
COPY pyproject.toml README.md ./
COPY common common
COPY server server
COPY client client
COPY protos protos
RUN pip wheel --no-cache-dir --wheel-dir /wheels --extra-index-url "${TORCH_INDEX}" .

FROM ${BASE_IMAGE}
# The CUDA base has no Python of its own: install one (a no-op on the python base).
RUN if ! command -v python3 >/dev/null; then apt-get update && apt-get install -y --no-install-recommends python3 python3-pip \
      && rm -rf /var/lib/apt/lists/* && ln -s /usr/bin/python3 /usr/local/bin/python; fi
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin fedforge \
 && mkdir -p /state /data /certs && chown fedforge:fedforge /state /data /certs
COPY --from=build /wheels /wheels
RUN python -m pip install --no-cache-dir --no-index --find-links /wheels fedforge \
      $( [ -f /usr/lib/python3*/EXTERNALLY-MANAGED ] && echo --break-system-packages ) && rm -rf /wheels
ENV FLWR_TELEMETRY_ENABLED=0 FEDFORGE_TORCH_THREADS=1 PYTHONUNBUFFERED=1
USER fedforge
WORKDIR /state
EXPOSE 50062
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
  CMD python -c "import grpc; from common.rpc.fedforge.v1 import edge_pb2, edge_pb2_grpc; \
edge_pb2_grpc.EdgeAgentStub(grpc.insecure_channel('127.0.0.1:50061')).Health(edge_pb2.HealthRequest(), timeout=3)"
ENTRYPOINT ["fedforge"]
CMD ["client", "--help"]
