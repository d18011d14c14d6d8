# Slim image running the gateway, under one name wherever it is used (deploy/compose.yaml, deploy/k8s/):
#   docker build -t shapegate:0.1.0 .
#   docker run -v ./config.toml:/etc/shapegate/config.toml -p 8080:8080 shapegate:0.1.0
# The same image runs the engine simulator (`sim ...`, deploy/compose.yaml) and the configuration watcher that
# reloads the gateway when a Kubernetes ConfigMap changes (deploy/k8s/gateway.yaml).

# The request path's modules compiled with mypyc (deploy/compile.py) in a stage that has a C compiler; the
# image takes the compiled tree and runs it from /app, ahead of the plain copy pip installs.
FROM python:3.11 AS compiled
WORKDIR /app
COPY pyproject.toml README.md LICENSE ./
COPY gateway ./gateway
COPY policies ./policies
COPY backends ./backends
COPY deploy/__init__.py deploy/compile.py ./deploy/
RUN pip install --no-cache-dir . mypy==2.4.1 && python deploy/compile.py

FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=/app
WORKDIR /app
COPY --from=compiled /app /app
RUN pip install --no-cache-dir . \
    && groupadd --system --gid 10001 shapegate \
    && useradd --system --uid 10001 --gid 10001 --no-create-home shapegate
COPY deploy/config_watch.py /usr/local/bin/shapegate-config-watch

# Numeric, so that Kubernetes' runAsNonRoot can tell it is not root.
USER 10001:10001
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=2s CMD python -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8080/healthz').status == 200 else 1)"
ENTRYPOINT ["shapegate"]
CMD ["serve", "--config", "/etc/shapegate/config.toml", "--host", "0.0.0.0", "--port", "8080"]
