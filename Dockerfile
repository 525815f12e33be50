# Sluice in a small image: a release build, then only the binary and the example configs on a
# slim Debian, run as an unprivileged user. README "Installing" says how to run it. Untested on
# the project's test machine (no Docker daemon there); tests/it/deploy.rs checks this file's
# user, ports and health check.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p sluice

FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin sluice \
    && install -d -m 0750 -o sluice -g sluice /var/log/sluice
COPY --from=build /src/target/release/sluice /usr/local/bin/sluice
COPY conf/sluice.toml conf/production.toml /etc/sluice/examples/
# The config to run on: mount yours here (its listen addresses on 0.0.0.0 to be reachable).
COPY conf/sluice.toml /etc/sluice/sluice.toml
USER sluice
EXPOSE 8080 9090
# /healthz on the admin listener, with nothing but bash (no curl in the image).
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
    CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/9090 && printf 'GET /healthz HTTP/1.0\\r\\n\\r\\n' >&3 && head -1 <&3 | grep -q ' 200 '"]
ENTRYPOINT ["/usr/local/bin/sluice"]
CMD ["--config", "/etc/sluice/sluice.toml"]
