# syntax=docker/dockerfile:1
#
# queuekeeper in two stages: `build` makes a virtualenv (with a compiler at hand, for any
# dependency without a wheel for the platform); `runtime` copies only that virtualenv onto
# a clean slim image and runs it as an unprivileged user.
#
#   docker build -t queuekeeper .
#   docker run --env-file .env queuekeeper queuekeeper migrate
#   docker run --env-file .env -p 8000:8000 queuekeeper
#
# Offline (no registry, no PyPI), as tests/ops/test_image.py builds it: any Debian-like
# base with python3 and python3-venv, dependencies from wheels put in deploy/wheelhouse/:
#
#   docker build --build-arg BASE_IMAGE=localhost/debian-python:bookworm \
#     --build-arg BUILD_PACKAGES= \
#     --build-arg PIP_INSTALL_OPTIONS="--no-index --find-links /build/wheelhouse" .

ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
# Compilers for a dependency without a wheel; empty when every wheel is at hand.
ARG BUILD_PACKAGES="gcc libc6-dev"
ARG PIP_INSTALL_OPTIONS=""
# hadolint ignore=DL3008,SC2086
RUN if [ -n "$BUILD_PACKAGES" ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends $BUILD_PACKAGES \
        && rm -rf /var/lib/apt/lists/*; \
    fi
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/queuekeeper
WORKDIR /build
COPY pyproject.toml README.md ./
COPY src ./src
COPY migrations ./migrations
COPY deploy/wheelhouse ./wheelhouse
# hadolint ignore=SC2086
RUN /opt/queuekeeper/bin/pip install $PIP_INSTALL_OPTIONS .

FROM ${BASE_IMAGE} AS runtime
LABEL org.opencontainers.image.title="queuekeeper" \
      org.opencontainers.image.description="Owns the RabbitMQ queues through which a backend sends events to site agents."
RUN groupadd --system --gid 10001 queuekeeper \
    && useradd --system --uid 10001 --gid queuekeeper --create-home \
       --home-dir /home/queuekeeper --shell /usr/sbin/nologin queuekeeper
COPY --from=build /opt/queuekeeper /opt/queuekeeper
ENV PATH=/opt/queuekeeper/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    QUEUEKEEPER_HOST=0.0.0.0 \
    QUEUEKEEPER_PORT=8000 \
    QUEUEKEEPER_LOG_FORMAT=json
WORKDIR /home/queuekeeper
USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["queuekeeper", "healthcheck"]
CMD ["queuekeeper", "serve"]
