# syntax=docker/dockerfile:1
# The agentrace binary on distroless: what config/k8s/ runs as `agentrace:latest`.
#   docker build -t agentrace --build-arg GIT_SHA=$(git rev-parse HEAD) .
# Pin the base images by digest (`image@sha256:…`) where builds must be reproducible.

# glibc rather than musl: the binary CI builds and benchmarks is the one shipped, and
# mimalloc replaces the C library's allocator either way.
FROM rust:1.85-bookworm AS chef
RUN cargo install cargo-chef --locked
WORKDIR /src

# The dependency graph alone, so the dependency layer is rebuilt only when Cargo.lock changes.
FROM chef AS planner
COPY . .
RUN cargo chef prepare --recipe-path recipe.json

FROM chef AS builder
COPY --from=planner /src/recipe.json recipe.json
RUN cargo chef cook --release --locked --recipe-path recipe.json
COPY . .
# .git stays out of the context, so build.rs takes the commit for --version from here.
ARG GIT_SHA=unknown
ENV AGENTRACE_GIT_COMMIT=${GIT_SHA}
# The same command .ci/run builds with (tests/dockerfile.rs checks that they agree).
RUN cargo build --release --locked --bin agentrace

# distroless cc: glibc and libgcc, no shell, and the CA bundle that https:// backends need
# without upstream.ca_file.
FROM gcr.io/distroless/cc-debian12:nonroot AS runtime
ARG GIT_SHA=unknown
ARG VERSION=0.1.0
LABEL org.opencontainers.image.source="https://github.com/agentrace/agentrace" \
      org.opencontainers.image.revision="${GIT_SHA}" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=builder /src/target/release/agentrace /usr/local/bin/agentrace
USER 65532:65532
RUN ["/usr/local/bin/agentrace", "--version"]
# proxy, endpoint picker (gRPC), admin (/metrics, /admin/*)
EXPOSE 8080 9002 9464
ENTRYPOINT ["/usr/local/bin/agentrace"]
CMD ["proxy", "--config", "/etc/agentrace/proxy.toml"]
