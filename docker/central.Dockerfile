# FedForge central site: SuperLink (with the ServerApp runtime), model registry (gRPC) and dashboard.
#   docker build -f docker/central.Dockerfile -t fedforge-central .
# torch comes from the CPU wheel index unless TORCH_INDEX says otherwise (the central site needs no GPU).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
WORKDIR /src
RUN pip install --no-cache-dir --upgrade pip wheel
COPY pyproject.toml README.md ./
COPY common common
COPY server server
COPY client client
COPY protos protos
RUN pip wheel --no-cache-dir --wheel-dir /wheels --extra-index-url "${TORCH_INDEX}" ".[export]"

FROM ${PYTHON_IMAGE}
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin fedforge \
 && mkdir -p /data /certs /app && chown fedforge:fedforge /data /certs /app
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels "fedforge[export]" && rm -rf /wheels  # export: ONNX too
# The Flower app directory `flwr run` bundles (code and pyproject only: the FAB stays small).
COPY --chown=fedforge:fedforge pyproject.toml README.md /app/
COPY --chown=fedforge:fedforge common /app/common
COPY --chown=fedforge:fedforge server /app/server
COPY --chown=fedforge:fedforge client /app/client
ENV FEDFORGE_APP_DIR=/app FLWR_TELEMETRY_ENABLED=0 FEDFORGE_TORCH_THREADS=1 PYTHONUNBUFFERED=1
USER fedforge
WORKDIR /data
EXPOSE 8000 8080 50051
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
  CMD python -c "import socket; socket.create_connection(('127.0.0.1', 8000), 3)"
ENTRYPOINT ["fedforge"]
CMD ["server", "--workdir", "/data", "--host", "0.0.0.0", "--tls", "--certs-dir", "/certs", \
     "--registry-listen", "0.0.0.0:50051", "--dashboard-listen", "0.0.0.0:8080"]
