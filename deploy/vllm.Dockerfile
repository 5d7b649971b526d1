# vLLM's own serving image with kvstore's connector installed (docker-compose.vllm.yml).
#
#   docker build -f deploy/vllm.Dockerfile -t kvstore:vllm .
#
# The base image brings vLLM (0.32.0, the version the connector is tested with)
# and its CUDA torch; kvstore adds only its light dependencies (grpcio, protobuf,
# numpy, redis). Engines reach their node over gRPC and map its pool volume.
FROM vllm/vllm-openai:v0.32.0
WORKDIR /opt/kvstore
COPY pyproject.toml README.md ./
COPY kvstore ./kvstore
COPY service ./service
RUN pip install --no-cache-dir . && rm -rf /opt/kvstore/build
WORKDIR /
