# sdv-fanout server image: a venv built in one stage, copied into a slim runtime as a non-root user.
FROM python:3.11-slim AS build
WORKDIR /src
COPY requirements-runtime.txt setup.cfg pyproject.toml README.md ./
COPY exhook_server ./exhook_server
COPY storage ./storage
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir -r requirements-runtime.txt \
    && /opt/venv/bin/pip install --no-cache-dir --no-deps .

FROM python:3.11-slim
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/sdv-fanout --create-home sdv
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    SDV_FANOUT_DATA_DIR=/var/lib/sdv-fanout/lmdb \
    SDV_FANOUT_LOG_FORMAT=json \
    SDV_FANOUT_LISTEN=0.0.0.0:9000 \
    SDV_FANOUT_METRICS_LISTEN=0.0.0.0:9100
# LMDB lives here: mount a persistent volume (a StatefulSet PVC in deploy/k8s).
VOLUME ["/var/lib/sdv-fanout"]
USER 10001:10001
WORKDIR /var/lib/sdv-fanout
# 9000: ExHook + health + reflection (gRPC); 9100: Prometheus /metrics. A container is reached from
# outside, so both listen on every interface here (the server's own defaults are loopback); the
# Admin API stays on 127.0.0.1:9001 (`docker exec ... sdv-fanout stats --server`).
EXPOSE 9000 9100
ENTRYPOINT ["sdv-fanout", "serve"]
