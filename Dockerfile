# Nomad's image: every service binary, python3 for the gateway's sandbox, and the model fetcher.
#
#   docker build -t nomad:latest .                       # CPU
#   docker build -t nomad:cuda \
#     --build-arg BUILD_BASE=nvidia/cuda:12.4.1-devel-ubuntu22.04 \
#     --build-arg RUNTIME_BASE=nvidia/cuda:12.4.1-runtime-ubuntu22.04 \
#     --build-arg CARGO_FEATURES=cuda .                  # GPU workers
#
# Without a registry, deploy/docker/build-prebuilt-image makes the same image from binaries
# built on the host.
ARG BUILD_BASE=rust:1.90-bookworm
ARG RUNTIME_BASE=debian:bookworm-slim

FROM ${BUILD_BASE} AS build
ARG CARGO_FEATURES=""
# The CUDA bases have no Rust toolchain: install one there.
RUN if ! command -v cargo >/dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends curl ca-certificates build-essential \
      && curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --default-toolchain 1.90; \
    fi
ENV PATH=/root/.cargo/bin:/usr/local/cargo/bin:$PATH
WORKDIR /src
COPY . .
RUN cargo build --release --locked --workspace --bins \
    && if [ -n "$CARGO_FEATURES" ]; then \
         cargo build --release --locked -p nomad-device-worker --features "$CARGO_FEATURES"; \
       fi \
    && mkdir /out \
    && cp target/release/nomad target/release/nomad-scheduler target/release/nomad-gateway \
          target/release/nomad-device-worker target/release/deps/libnomad_jail.so /out/ \
    && cp scripts/fetch-models /out/nomad-fetch-models

FROM ${RUNTIME_BASE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-pip ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/ /usr/local/bin/
ENV NOMAD_MODELS_DIR=/models LANG=C.UTF-8
WORKDIR /work
CMD ["nomad", "--help"]
