# The driftless image (agent sidecar, gc CronJob, publisher):
#   docker build -f docker/agent.Dockerfile -t driftless:latest .
# Not built in CI (no Docker engine there); .dockerignore keeps target/ out of the context.
#
# Stages: `planner` reduces the workspace to its dependency recipe (cargo-chef), `build`
# compiles the dependencies from the recipe alone (a layer that stays cached until Cargo.lock
# or a manifest changes), then the sources, into a stripped release binary; the runtime image
# is debian-slim with CA certificates and that one binary.
FROM rust:1-bookworm AS chef
RUN cargo install cargo-chef --locked --version ^0.1
WORKDIR /src

FROM chef AS planner
COPY . .
RUN cargo chef prepare --recipe-path recipe.json

FROM chef AS build
ENV CARGO_PROFILE_RELEASE_DEBUG=0 \
    CARGO_PROFILE_RELEASE_STRIP=symbols
COPY --from=planner /src/recipe.json recipe.json
RUN cargo chef cook --release --locked -p driftless-cli --recipe-path recipe.json
COPY . .
RUN cargo build --release --locked -p driftless-cli \
 && cp target/release/driftless /driftless

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /driftless /usr/local/bin/driftless
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/driftless"]
CMD ["--help"]
