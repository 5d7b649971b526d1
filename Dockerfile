# One image for the cache node and the example runners (docker-compose.yml).
#
#   docker build -t kvstore:dev .                      # node, SDK, CLI: no torch (small)
#   docker build -t kvstore:hf --build-arg EXTRAS=hf .  # + CPU torch and transformers
#
# EXTRAS names the project's extras (torch, hf, vllm, nixl, events; comma-separated).
# When one of them needs torch, torch comes first from TORCH_INDEX_URL (PyTorch's CPU
# index): a plain `pip install torch` from PyPI resolves the CUDA build and its NVIDIA
# wheels (several GB). `--build-arg EXTRAS=nixl,events` gives a node NIXL and KV
# events, without torch.
#
# BASE_IMAGE is any Debian-like image with Python 3.11+ whose `python` and `pip`
# are on PATH: python:3.11-slim, or the one scripts/compose_check.sh builds from
# Debian's packages where no container registry can be reached (docs/deploy.md).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ARG EXTRAS=""
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
# Nodes and runners run as one unprivileged user, so pool files (mode 0600, or
# 0660 with KVSTORE_POOL_FILE_GROUP=10001) open in every container; the pool
# volumes of docker-compose.yml are tmpfs owned by this uid. /kvstore/disk is where
# a node's disk-tier volume mounts: a new named volume takes this folder's owner.
RUN groupadd --gid 10001 kvstore \
 && useradd --uid 10001 --gid 10001 --create-home kvstore \
 && mkdir -p /kvstore/pools /kvstore/disk && chown kvstore:kvstore /kvstore/pools /kvstore/disk
WORKDIR /app
# Dependencies first, from pyproject.toml alone (an empty README and packages
# stand in for the rest), so a change to the code or README rebuilds only the
# last pip layer below. torch alone comes from TORCH_INDEX_URL; its own
# dependencies (filelock, sympy, ...) come from PyPI with the project's, so that
# index needs to hold torch only.
COPY pyproject.toml ./
RUN mkdir -p kvstore service && touch README.md kvstore/__init__.py service/__init__.py \
 && case ",$EXTRAS," in \
      *,torch,*|*,hf,*|*,cuda,*|*,vllm,*|*,dev,*) \
        pip install --no-cache-dir --no-deps --index-url "$TORCH_INDEX_URL" torch ;; \
    esac \
 && pip install --no-cache-dir ".${EXTRAS:+[$EXTRAS]}" \
 && pip uninstall -y kvstore && rm -rf README.md kvstore service build
COPY README.md ./
COPY kvstore ./kvstore
COPY service ./service
COPY examples ./examples
RUN pip install --no-cache-dir --no-deps . && rm -rf build
USER kvstore
EXPOSE 50051 9400
CMD ["python", "-m", "service"]
