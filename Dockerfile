# Murmur peer for rented GPUs (also runs on CPU-only hosts). See docs/deploy.md.
#   Build:            docker build -t murmur .
#   Bootstrap node:   docker run -d --gpus all -p 4001:4001 -v murmur-data:/data murmur \
#                       --announce /ip4/<public ip>/tcp/4001
#   Peer:             docker run -d --gpus all -p 4001:4001 -v murmur-data:/data murmur \
#                       --bootstrap /ip4/<bootstrap ip>/tcp/4001/p2p/<bootstrap peer id>
# Arguments after the image name are appended to the ENTRYPOINT (`murmur run …`).
# The base image brings a CUDA build of torch (Murmur needs torch>=2.13,<2.15) and
# its CUDA runtime; the host needs only an NVIDIA driver and the container toolkit.
# Pick a CUDA version your host's driver supports: --build-arg BASE_IMAGE=….
# scripts/docker_check.sh builds it on a Debian base with no registry and runs two peers of it.
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

# MURMUR_DATA_DIR: `docker exec <container> murmur status` finds the node without flags.
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    MURMUR_DATA_DIR=/data

WORKDIR /app
COPY pyproject.toml README.md ./
COPY node ./node
COPY protocol ./protocol
COPY murmur ./murmur
# `pip install .` installs the distribution murmur-gossip: the package and command `murmur`.
# The base image's torch satisfies the dependency, so pip adds only Murmur and its
# small dependencies; the check fails the build if the image's torch has no CUDA.
# fastecdsa (a py-libp2p dependency) has no Linux wheel: it compiles against GMP, so a
# compiler and GMP's headers are installed for the build, and every package the build
# added is removed after it except libgmp10, which fastecdsa links to at run time. (A
# purge --auto-remove would keep gcc wherever the base has libc6-dev, which recommends it.)
RUN installed() { dpkg-query -W -f '${db:Status-Status} ${binary:Package}\n' | awk '$1 == "installed" {print $2}' | sort; } \
    && installed > /tmp/packages-before \
    && apt-get update \
    && apt-get install -y --no-install-recommends build-essential libgmp-dev \
    && pip install . \
    && apt-mark manual libgmp10 \
    && installed | comm -13 /tmp/packages-before - | sed '/^libgmp10/d' > /tmp/packages-added \
    && apt-get purge -y $(cat /tmp/packages-added) \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/* /tmp/packages-* \
    && python -c "import torch, fastecdsa.curve, murmur.node.cli; assert torch.version.cuda, 'base image torch has no CUDA'"

RUN useradd --create-home --uid 10001 murmur \
    && mkdir /data && chown murmur:murmur /data
USER murmur

# identity.key, checkpoints/, status.json, metrics: keep them across restarts.
VOLUME /data
# libp2p TCP port (publish it: -p 4001:4001).
EXPOSE 4001/tcp

# Healthy while the node keeps its status file fresh and its process is alive.
# start-period: importing torch, joining and state sync come before the first status.
HEALTHCHECK --interval=30s --timeout=10s --start-period=120s --retries=3 \
    CMD ["murmur", "status", "--data-dir", "/data", "--health"]

# Options given to `docker run … murmur OPTIONS` are appended: a repeated single-valued
# option (--device cpu) overrides the one here, another --listen adds an address.
ENTRYPOINT ["murmur", "run", "--data-dir", "/data", "--listen", "/ip4/0.0.0.0/tcp/4001", "--device", "auto"]
CMD []
