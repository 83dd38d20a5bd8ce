# The factory's Dagster code location (assets, sensors, resources, the gateway): the image the
# Helm chart's user deployment runs with `dagster api grpc -m factory.definitions`. Training
# itself runs in the trainer image; this one only orchestrates.
# Build from the repository root: docker build -f docker/factory.Dockerfile -t factory .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    FACTORY_HOME=/var/lib/factory

WORKDIR /app
# jemalloc: `python -m factory.trainer` (the local provider's trainers) preloads it.
RUN apt-get update && apt-get install -y --no-install-recommends libjemalloc2 \
    && rm -rf /var/lib/apt/lists/*
RUN pip install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY factory/ factory/
COPY assets/ assets/
COPY resources/ resources/
COPY sensors/ sensors/
COPY trainer/ trainer/
COPY kernels/ kernels/
COPY experiments/ experiments/
RUN pip install ".[k8s]"

RUN useradd --create-home --uid 1000 factory && mkdir -p /var/lib/factory \
    && chown 1000 /var/lib/factory
USER 1000
EXPOSE 3030

CMD ["dagster", "api", "grpc", "-h", "0.0.0.0", "-p", "3030", "-m", "factory.definitions"]
