# One image for every oncely process; the entrypoint is the `oncely` CLI:
#   docker build -t oncely:dev .                            (make image does this with podman)
#   docker build -t oncely:dev --build-arg EXTRAS=confluent .   (with the schema-registry client)
#   docker run --rm --read-only oncely:dev relay run --metrics-port 9400
# BASE_IMAGE is any Debian-like image with python3 and its venv module (3.11+); `make image`
# passes a locally built Debian one where no registry is reachable.
ARG BASE_IMAGE=python:3.12.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG EXTRAS=""
# A CA bundle pip should trust, mounted by the build (make image); never copied into the image.
ARG PIP_CERT
WORKDIR /src
RUN python3 -m venv /opt/oncely
COPY pyproject.toml README.md ./
COPY src ./src
RUN /opt/oncely/bin/pip install --no-cache-dir --disable-pip-version-check ".${EXTRAS:+[$EXTRAS]}"

FROM ${BASE_IMAGE}
ARG VERSION=0.1.0.dev0
ARG SOURCE=""
ARG REVISION=""
LABEL org.opencontainers.image.title="oncely" \
      org.opencontainers.image.description="Transactional outbox to Kafka to effects: the relay, consumers and task workers" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --gid 10001 oncely \
 && useradd --uid 10001 --gid 10001 --home-dir /app --no-create-home --shell /usr/sbin/nologin oncely
COPY --from=build /opt/oncely /opt/oncely
ENV PATH=/opt/oncely/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
# `oncely` imports module:attribute targets (--app) from here: mount or COPY your application.
WORKDIR /app
USER 10001:10001
# Asks the process's own ports, whatever --metrics-port it was given (oncely healthcheck --help).
HEALTHCHECK --interval=10s --timeout=10s --start-period=30s --retries=3 CMD ["oncely", "healthcheck"]
ENTRYPOINT ["oncely"]
CMD ["--help"]
