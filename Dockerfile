# Both binaries in one small image; the chart runs `dropgate-operator run`, shops run
# `dropgate-sidecar` next to their containers.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p dropgate-operator -p dropgate-sidecar

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/dropgate-operator /src/target/release/dropgate-sidecar /usr/local/bin/
USER 65532
ENTRYPOINT ["dropgate-operator"]
