# The trainer image: `python -m trainer --job FILE` and nothing else (no Dagster, no lake, no
# orchestration). Kubernetes Jobs and sandboxes run it with the job file mounted or copied in.
# Build from the repository root: docker build -f docker/trainer.Dockerfile -t factory-trainer .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    HF_HUB_OFFLINE=1

WORKDIR /app
# jemalloc: `python -m trainer` preloads it (glibc's malloc fragments a long run's heap).
RUN apt-get update && apt-get install -y --no-install-recommends libjemalloc2 \
    && rm -rf /var/lib/apt/lists/*
# CUDA build of the same torch the project pins (the CPU build is only for the dev machine).
RUN pip install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cu128
RUN pip install "transformers>=5.0,<6" "peft>=0.17" "accelerate>=1.0" safetensors fsspec \
        s3fs gcsfs httpx numpy pyarrow "triton>=3.0"

COPY trainer/ trainer/
COPY kernels/ kernels/

RUN useradd --create-home --uid 1000 trainer
USER 1000

ENTRYPOINT ["python", "-m", "trainer"]
