# One image for the cache node and the example runners (docker-compose.yml).
#
#   docker build -t kvstore:dev .                      # node, SDK, CLI: no torch (small)
#   docker build -t kvstore:hf --build-arg EXTRAS=hf .  # + CPU torch and transformers
#
# EXTRAS names the project's extras (torch, hf, vllm, nixl, events; comma-separated).
# When one of them needs torch, torch comes first from PyTorch's CPU index: a plain
# `pip install torch` from PyPI resolves the CUDA build and its NVIDIA wheels (several
# GB). `--build-arg EXTRAS=nixl,events` gives a node NIXL and KV events, without torch.
FROM python:3.11-slim
ARG EXTRAS=""
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
WORKDIR /app
COPY pyproject.toml README.md ./
COPY kvstore ./kvstore
COPY service ./service
COPY examples ./examples
RUN case ",$EXTRAS," in \
      *,torch,*|*,hf,*|*,cuda,*|*,vllm,*|*,dev,*) \
        pip install --no-cache-dir --index-url "$TORCH_INDEX_URL" torch ;; \
    esac \
 && pip install --no-cache-dir ".${EXTRAS:+[$EXTRAS]}"
# Nodes and runners run as one unprivileged user, so pool files (mode 0600, or
# 0660 with KVSTORE_POOL_FILE_GROUP=10001) open in every container; the pool
# volumes of docker-compose.yml are tmpfs owned by this uid.
RUN groupadd --gid 10001 kvstore \
 && useradd --uid 10001 --gid 10001 --create-home kvstore \
 && mkdir -p /kvstore/pools && chown kvstore:kvstore /kvstore/pools
USER kvstore
EXPOSE 50051 9400
CMD ["python", "-m", "service"]
