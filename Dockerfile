# A pipeswarm peer. `docker build -t pipeswarm .` then e.g.
#   docker run --gpus all -p 31337:31337 pipeswarm join --stage auto --port 31337 \
#       --initial-peers /ip4/<bootstrap ip>/tcp/<port>/p2p/<peer id> --announce /ip4/<your public ip>/tcp/31337
# TORCH_SPEC picks the torch build; point pip at your preferred wheel index with PIP_INDEX_URL /
# PIP_EXTRA_INDEX_URL build args for a CPU-only or a specific CUDA build.
FROM python:3.11-slim

ARG TORCH_SPEC="torch==2.13.0"
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
WORKDIR /opt/pipeswarm
COPY pyproject.toml README.md ./
COPY node ./node
COPY protocol ./protocol
COPY dht ./dht

RUN pip install --no-cache-dir "$TORCH_SPEC" && pip install --no-cache-dir .

EXPOSE 31337
ENTRYPOINT ["node"]
CMD ["--help"]
