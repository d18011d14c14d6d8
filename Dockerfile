# Slim image running the gateway: docker run -v ./config.toml:/etc/shapegate/config.toml -p 8080:8080 shapegate
FROM python:3.11-slim

WORKDIR /app
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY policies ./policies
COPY backends ./backends
RUN pip install --no-cache-dir . && useradd --system --uid 10001 shapegate

USER shapegate
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=2s CMD python -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8080/healthz').status == 200 else 1)"
ENTRYPOINT ["shapegate"]
CMD ["serve", "--config", "/etc/shapegate/config.toml", "--host", "0.0.0.0", "--port", "8080"]
