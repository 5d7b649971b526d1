# One image for the cache node and the example runners (docker-compose.yml).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY kvstore ./kvstore
COPY service ./service
COPY examples ./examples
RUN pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu .
EXPOSE 50051 9400
CMD ["python", "-m", "service"]
