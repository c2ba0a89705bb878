# Both binaries in one small image; the chart runs `dropgate-operator run`, shops run
# `dropgate-sidecar` next to their containers.
#
# The bases are pinned by digest (the tag says which release it is): a tag can be
# moved to other contents, a digest cannot. To move to a newer base, look its
# digest up (`crane digest rust:1.95-bookworm`, `docker buildx imagetools inspect
# gcr.io/distroless/cc-debian12:nonroot`) and change both here.
FROM rust:1.95-bookworm@sha256:6258907abe69656e41cd992e0b705cdcfabcbbe3db374f92ed2d47121282d4a1 AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p dropgate-operator -p dropgate-sidecar

FROM gcr.io/distroless/cc-debian12:nonroot@sha256:9dac0a79194e45a7da0158a9c6da57b217585af0786db3845d1f0ec1a0dd182f
COPY --from=build /src/target/release/dropgate-operator /src/target/release/dropgate-sidecar /usr/local/bin/
USER 65532
ENTRYPOINT ["dropgate-operator"]
