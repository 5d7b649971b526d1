# One image for the cache node and the example runners (docker-compose.yml).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY kvstore ./kvstore
COPY service ./service
COPY examples ./examples
# torch first and pinned to a CPU build; then the project with the transformers extra.
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
 && pip install --no-cache-dir ".[hf]"
EXPOSE 50051 9400
CMD ["python", "-m", "service"]
