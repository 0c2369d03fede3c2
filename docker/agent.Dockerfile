# The driftless sidecar image: `docker build -f docker/agent.Dockerfile -t driftless:latest .`
# (not built in CI: these machines have no Docker engine).
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p driftless-cli

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/driftless /usr/local/bin/driftless
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/driftless"]
CMD ["agent", "--help"]
