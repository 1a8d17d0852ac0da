# A pipeswarm peer: the image's entrypoint is `node`, CPU torch by default.
#
#   make docker-image                          # podman, with the flags and local wheels this needs here
#   docker build -t pipeswarm .                # anywhere a Docker engine and Docker Hub are reachable
#   docker run --init --network host -v pipeswarm-state:/var/lib/pipeswarm pipeswarm join --stage auto \
#       --port 31337 --direct-port 31338 --initial-peers /ip4/<bootstrap ip>/tcp/<port>/p2p/<peer id>
#
# docs/operations.md ("In a container") has the volumes, ports, ulimits and the CUDA variant.
#
# BASE: any Debian-like image with Python 3.11 (python3 -m venv must work). `make docker-image` uses
# python:3.11-slim when it can be pulled and otherwise a Debian bookworm made with debootstrap from
# the machine's Debian mirror (tests/container/image.py).
ARG BASE=docker.io/library/python:3.11-slim
FROM ${BASE}

# TORCH_SPEC picks the torch build: a requirement (torch==2.13.0 takes PyPI's default build, CUDA on
# x86_64, several GB) or the path of a wheel mounted at build time (`make docker-image` mounts the
# local CPU wheel, so nothing is downloaded for torch). PIP_* point pip at an index, a folder of wheels
# or a CA bundle mounted at build time (podman build -v): they are build arguments, not files, so
# nothing of the build machine's is baked into the image.
ARG TORCH_SPEC="torch==2.13.0"
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_CERT

# a venv: Debian's own python refuses `pip install` outside one (PEP 668), python:3.11-slim does not care
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    XDG_STATE_HOME=/var/lib/pipeswarm/state
RUN python3 -m venv /opt/venv

# torch in a layer of its own: it is most of the image and changes far less often than the code
RUN pip install --no-cache-dir "$TORCH_SPEC"

WORKDIR /opt/pipeswarm
COPY pyproject.toml README.md ./
COPY node ./node
COPY protocol ./protocol
COPY dht ./dht
# the import smoke test fails the build on a runtime dependency that only a dev/test extra brings
RUN pip install --no-cache-dir . && python -c "import node.cli, node.server.stage_service, node.monitor.observer, torch; print(torch.__version__)"

# a peer accepts bytes from strangers: it runs unprivileged. Its identity key (and a bootstrap's
# founder key) lives under XDG_STATE_HOME=/var/lib/pipeswarm/state: mount a volume there to keep
# the peer id across containers.
RUN useradd --uid 10001 --home-dir /var/lib/pipeswarm --create-home --shell /usr/sbin/nologin pipeswarm
USER pipeswarm
WORKDIR /var/lib/pipeswarm
VOLUME /var/lib/pipeswarm

# 31337: libp2p (`--port`); 31338: direct links for pipeline traffic (`--direct-port 31338`, node/p2p/direct.py)
EXPOSE 31337 31338
ENTRYPOINT ["node"]
CMD ["--help"]
