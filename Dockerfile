# syntax=docker/dockerfile:1
#
# One image with every binary of the workspace: relay, consumer, producer, payment-provider,
# console (and bench).
# docker-compose.yml builds it once and picks the binary per service with `command:`.
#
#   docker build -t outbox:local .
#   docker run --rm outbox:local relay --help
#
# The build stage uses BuildKit cache mounts (BuildKit is the default builder since Docker 23 and
# in `docker compose`), so rebuilds after a source change recompile the workspace, not the
# dependencies.

ARG RUST_VERSION=1.95
ARG DEBIAN_RELEASE=bookworm

FROM rust:${RUST_VERSION}-${DEBIAN_RELEASE} AS build
WORKDIR /src
COPY . .
# sqlx::migrate! embeds migrations/ at compile time: no database is needed to build.
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    --mount=type=cache,target=/usr/local/cargo/git,sharing=locked \
    --mount=type=cache,target=/src/target,sharing=locked \
    cargo build --release --locked --bins \
    && mkdir -p /out \
    && cp target/release/relay target/release/consumer target/release/producer \
        target/release/payment-provider target/release/console /out/

FROM debian:${DEBIAN_RELEASE}-slim AS runtime
# ca-certificates for TLS endpoints (amqps://, sslmode=require); curl for health checks.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates curl \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 outbox \
    && useradd --system --uid 10001 --gid outbox --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin outbox
COPY --from=build /out/ /usr/local/bin/
USER outbox:outbox
ENV LOG_FORMAT=json
# producer: LISTEN_ADDR (API, /metrics, /healthz, /readyz); relay and consumer: METRICS_ADDR;
# payment-provider: PROVIDER_ADDR (8090).
# console: CONSOLE_ADDR (web page, API, /metrics, /healthz, /readyz).
# Bind them to 0.0.0.0 in a container (the binaries default to 127.0.0.1).
EXPOSE 8070 8080 8090 9100
STOPSIGNAL SIGTERM
CMD ["relay", "run"]
