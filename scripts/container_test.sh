#!/usr/bin/env bash
# The container check (heavy, not part of `make test`; `make container-test` runs it): builds the CPU image
# with podman and runs it for real, on a machine without a Docker daemon or a container registry.
#
#   1. podman set-up and a Debian bookworm base image made locally with debootstrap (first run only)
#   2. build the CPU image (--build-arg VARIANT=cpu); print its size and the build time
#   3. run it; wait for `podman healthcheck run` to pass; print the time to healthy
#   4. a completion, a streamed chat completion, /metrics, the non-root user and the OCI labels
#   5. SIGTERM with a stream in flight: the stream must finish, /health must say 503 meanwhile, the
#      container must exit 0 (the drain, --shutdown-timeout)
#   6. the compose stack of docker-compose.cpu.yml (pagedserve + Prometheus) with podman-compose: Prometheus
#      must scrape the server (up == 1). Prometheus' image is built locally from Debian's package (no
#      registry); Grafana has no such package, so the stack runs without it.
#   7. its gateway profile: the second replica and nginx (also built from Debian's package): completions
#      through the gateway reach both replicas, and Prometheus discovers the second one (up == 1 for both).
#
# Needs root, podman, buildah, debootstrap, podman-compose (installed with apt-get when missing) and about
# 6 GB of disk under $PAGEDSERVE_CTR_DIR. Every published port is bound to 127.0.0.1. Exit status 0 when
# every check passed; it goes on after a failed check and lists the failures at the end.
set -uo pipefail
cd "$(dirname "$0")/.."

C=${PAGEDSERVE_CTR_DIR:-/tmp/pagedserve-ctr}
IMAGE=${PAGEDSERVE_TEST_IMAGE:-localhost/pagedserve:cpu-test}
PROM_IMAGE=localhost/prometheus-debian:test
NGINX_IMAGE=localhost/nginx-debian:test
PORT=${PAGEDSERVE_CTR_PORT:-18000}
STACK_PORT=$((PORT + 1))
PROM_PORT=$((PORT + 90))
GATEWAY_PORT=$((PORT + 80))
NAME=pagedserve-ctr-test
PROJECT=pagedserve-ctr-test
MODEL=SmolLM2-135M-Instruct
FAILED=()

log() { printf '\n== %s\n' "$*"; }
pass() { printf 'PASS %s\n' "$*"; }
fail() { printf 'FAIL %s\n' "$*"; FAILED+=("$*"); }
now() { date +%s.%N; }
# podman without systemd reports, on each container start and stop, that it cannot set healthcheck timers
# (expected here: the script runs `podman healthcheck run` itself): keep those lines out of the output.
pm() { podman "$@" 2> >(grep -v 'unable to get systemd connection' >&2); }
elapsed() { python3 -c "print(f'{$2 - $1:.1f}')"; }

cleanup() {
    podman rm -f "$NAME" >/dev/null 2>&1 || true
    if [ -n "${COMPOSE_UP:-}" ]; then
        podman-compose -p "$PROJECT" -f docker-compose.cpu.yml down -v >/dev/null 2>&1 || true
    fi
}
trap cleanup EXIT

# ------------------------------------------------------------------ 1. set-up (see the recipe this follows)
log "set-up in $C"
mkdir -p "$C"
need=()
for tool in podman buildah debootstrap podman-compose slirp4netns runc; do
    command -v "$tool" >/dev/null || need+=("$tool")
done
if [ ${#need[@]} -gt 0 ]; then
    echo "installing: ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman buildah debootstrap slirp4netns fuse-overlayfs \
        uidmap runc podman-compose >/dev/null
fi
# The VM's hard nofile limit is 20000 (default ulimits fail), crun refuses hybrid cgroups (runc works),
# no systemd (events to a file, cgroupfs).
cat > "$C/containers.conf" <<'EOF'
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
events_logger = "file"
cgroup_manager = "cgroupfs"
EOF
printf '[storage]\ndriver="overlay"\ngraphroot="%s/storage"\nrunroot="%s/runroot"\n' "$C" "$C" > "$C/storage.conf"
export CONTAINERS_CONF=$C/containers.conf CONTAINERS_STORAGE_CONF=$C/storage.conf
podman --version

if ! podman image exists localhost/debian:bookworm; then
    log "base image: debootstrap bookworm (about 80 s)"
    mirror=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null)
    [ -n "$mirror" ] || mirror=$(awk '/^deb /{print $2; exit}' /etc/apt/sources.list)
    rm -rf "$C/rootfs"
    debootstrap --variant=minbase bookworm "$C/rootfs" "$mirror" >"$C/debootstrap.log" 2>&1 \
        || { tail -20 "$C/debootstrap.log"; exit 1; }
    cp /etc/apt/sources.list.d/* "$C/rootfs/etc/apt/sources.list.d/" 2>/dev/null
    rm -f "$C/rootfs/etc/apt/sources.list"
    cp /etc/apt/apt.conf.d/* "$C/rootfs/etc/apt/apt.conf.d/" 2>/dev/null  # the machine's apt proxy, if any
    tar -C "$C/rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' - localhost/debian:bookworm
fi
# What `FROM debian:bookworm-slim` finds without a registry
podman tag localhost/debian:bookworm docker.io/library/debian:bookworm-slim

# ------------------------------------------------------------------ 2. build the CPU image
# HTTPS from a build is intercepted by a certificate this machine trusts: pip in the build gets its bundle.
printf '[global]\ncert = /run/host-ca.crt\n' > "$C/build-pip.conf"
build_args=(--build-arg VARIANT=cpu --build-arg "REVISION=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
            --build-arg "CREATED=$(date -u +%Y-%m-%dT%H:%M:%SZ)")
mounts=(-v /etc/ssl/certs/ca-certificates.crt:/run/host-ca.crt:ro -v "$C/build-pip.conf:/etc/pip.conf:ro")
# PyTorch's CPU index is not reachable here; a local directory of wheels holding torch's CPU build is
# (pip's find-links): mount it and take the rest from PyPI.
wheels=$(pip config get global.find-links 2>/dev/null || true)
if [ -n "$wheels" ] && ls "$wheels"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
    mounts+=(-v "$wheels:/wheels:ro")
    build_args+=(--build-arg PIP_FIND_LINKS=/wheels --build-arg TORCH_INDEX_URL=https://pypi.org/simple)
fi
log "build $IMAGE (VARIANT=cpu)"
start=$(now)
if podman build --network host --pull=never --format docker "${mounts[@]}" "${build_args[@]}" \
        -t "$IMAGE" -f Dockerfile . >"$C/build.log" 2>&1; then
    pass "image built in $(elapsed "$start" "$(now)") s"
else
    tail -40 "$C/build.log"
    fail "image build (log: $C/build.log)"
    exit 1
fi
size=$(podman image inspect "$IMAGE" --format '{{.Size}}')
echo "image size: $((size / 1000000)) MB ($(python3 -c "print(f'{$size / 2**30:.2f}')") GiB uncompressed)"
podman image inspect "$IMAGE" --format '{{json .Config.Labels}}' | python3 -c '
import json, sys
labels = json.load(sys.stdin)
oci = sorted(k for k in labels if k.startswith("org.opencontainers.image."))
print("OCI labels:", ", ".join(k.rsplit(".", 1)[1] for k in oci))
sys.exit(0 if len(oci) >= 6 else 1)' && pass "OCI labels" || fail "OCI labels"

# ------------------------------------------------------------------ 3. run, wait for the health check
log "run $IMAGE on 127.0.0.1:$PORT"
podman rm -f "$NAME" >/dev/null 2>&1
start=$(now)
pm run -d --name "$NAME" -p "127.0.0.1:$PORT:8000" --stop-timeout 40 "$IMAGE" >/dev/null
healthy=""
for _ in $(seq 300); do
    if podman healthcheck run "$NAME" >/dev/null 2>&1; then healthy=$(now); break; fi
    [ "$(pm inspect "$NAME" --format '{{.State.Running}}')" = true ] || break
    sleep 1
done
if [ -n "$healthy" ]; then
    pass "podman healthcheck run: healthy; time to healthy: $(elapsed "$start" "$healthy") s (container start to a passing check)"
else
    podman logs "$NAME" 2>&1 | tail -30
    fail "container never became healthy"
    exit 1
fi

# ------------------------------------------------------------------ 4. requests, metrics, user
URL=http://127.0.0.1:$PORT
log "requests"
reply=$(curl -sS -m 120 "$URL/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$MODEL\", \"prompt\": \"The capital of France is\", \"max_tokens\": 8, \"temperature\": 0}")
echo "completion: $reply"
echo "$reply" | python3 -c 'import json, sys; r = json.load(sys.stdin); assert r["choices"][0]["text"].strip() and r["usage"]["completion_tokens"] == 8' \
    && pass "completion" || fail "completion"

curl -sS -N -m 120 "$URL/v1/chat/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$MODEL\", \"stream\": true, \"max_tokens\": 16, \"temperature\": 0, \"messages\": [{\"role\": \"user\", \"content\": \"Name three colors.\"}]}" \
    > "$C/chat-stream.txt"
python3 - "$C/chat-stream.txt" <<'EOF' && pass "streamed chat completion" || fail "streamed chat completion"
import json, sys
events = [line[6:] for line in open(sys.argv[1]).read().splitlines() if line.startswith("data: ")]
assert events[-1] == "[DONE]", events[-3:]
chunks = [json.loads(event) for event in events[:-1]]
text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and text
assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
print(f"chat stream: {len(chunks)} chunks: {text!r}")
EOF

metrics=$(curl -sS -m 30 "$URL/metrics")
echo "$metrics" | grep -E '^pagedserve_(request_success_total|num_requests_running|kv_cache_usage_ratio)' | head -5
echo "$metrics" | grep -q '^pagedserve_request_success_total{' && echo "$metrics" | grep -q '^pagedserve_cache_config_info{' \
    && pass "/metrics" || fail "/metrics"
user=$(podman exec "$NAME" id -u)
[ "$user" = 10001 ] && pass "runs as non-root uid $user" || fail "runs as uid $user"

# ------------------------------------------------------------------ 5. SIGTERM with a stream in flight
log "SIGTERM with a stream in flight (the drain)"
curl -sS -N -m 120 "$URL/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$MODEL\", \"prompt\": \"Once upon a time\", \"stream\": true, \"max_tokens\": 120, \"ignore_eos\": true, \"temperature\": 0}" \
    > "$C/drain-stream.txt" &
stream_pid=$!
for _ in $(seq 100); do grep -q '^data: {' "$C/drain-stream.txt" 2>/dev/null && break; sleep 0.1; done
chunks_at_term=$(grep -c '^data: {' "$C/drain-stream.txt")
term_at=$(now)
pm kill --signal TERM "$NAME" >/dev/null
sleep 0.5
health=$(curl -s -o /dev/null -m 5 -w '%{http_code}' "$URL/health")
echo "stream chunks when SIGTERM was sent: $chunks_at_term; /health during the drain: $health"
wait "$stream_pid"
podman wait "$NAME" >/dev/null 2>&1
stopped=$(now)
code=$(pm inspect "$NAME" --format '{{.State.ExitCode}}')
python3 - "$C/drain-stream.txt" <<'EOF' && pass "the stream in flight finished after SIGTERM" || fail "the stream in flight was cut by SIGTERM"
import json, sys
events = [line[6:] for line in open(sys.argv[1]).read().splitlines() if line.startswith("data: ")]
assert events and events[-1] == "[DONE]", events[-2:]
chunks = [json.loads(event) for event in events[:-1]]
print(f"drained stream: {len(chunks)} chunks, finish_reason {chunks[-1]['choices'][0]['finish_reason']}")
assert chunks[-1]["choices"][0]["finish_reason"] == "length"
EOF
[ "$health" = 503 ] && pass "/health says 503 while draining" || fail "/health during the drain: $health (503 expected)"
echo "container stopped $(elapsed "$term_at" "$stopped") s after SIGTERM, exit code $code"
[ "$code" = 0 ] && pass "exit code 0 after the drain" || fail "exit code $code after SIGTERM (0 expected)"
pm logs "$NAME" 2>&1 | tail -6
podman rm -f "$NAME" >/dev/null

# ------------------------------------------------------------------ 6. the compose stack (CPU) with podman-compose
log "compose stack: docker-compose.cpu.yml with podman-compose (pagedserve + Prometheus)"
if ! podman image exists "$PROM_IMAGE"; then
    # Prometheus from Debian's package, with prom/prometheus' layout (config in /etc/prometheus, data in
    # /prometheus, runs as nobody) so the compose file's command works unchanged.
    podman build --network host --pull=never --format docker -t "$PROM_IMAGE" -f - . >"$C/prometheus-build.log" 2>&1 <<'EOF' \
        || { tail -20 "$C/prometheus-build.log"; fail "Prometheus image build"; exit 1; }
FROM localhost/debian:bookworm
RUN apt-get update && apt-get install -y --no-install-recommends prometheus && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /prometheus && chown nobody:nogroup /prometheus
USER nobody
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
EOF
fi
export PAGEDSERVE_IMAGE=$IMAGE PROMETHEUS_IMAGE=$PROM_IMAGE NGINX_IMAGE=$NGINX_IMAGE PAGEDSERVE_HOST_PORT=$STACK_PORT \
    PROMETHEUS_HOST_PORT=$PROM_PORT GATEWAY_HOST_PORT=$GATEWAY_PORT
podman-compose -p "$PROJECT" -f docker-compose.cpu.yml down -v >/dev/null 2>&1
COMPOSE_UP=1
# podman-compose 1.0 knows no profiles: name the services (Grafana has no image here).
if podman-compose -p "$PROJECT" -f docker-compose.cpu.yml up -d pagedserve prometheus >"$C/compose.log" 2>&1; then
    podman ps --filter "label=io.podman.compose.project=$PROJECT" --format '{{.Names}} {{.Image}} {{.Status}} {{.Ports}}'
else
    tail -30 "$C/compose.log"
    fail "podman-compose up"
fi
up=""
for _ in $(seq 180); do
    up=$(curl -s -m 5 "http://127.0.0.1:$PROM_PORT/api/v1/query" --data-urlencode 'query=up{job="pagedserve"}' \
        | python3 -c 'import json, sys; r = json.load(sys.stdin)["data"]["result"]; print(" ".join(s["metric"]["instance"] + "=" + s["value"][1] for s in r))' 2>/dev/null)
    case "$up" in *"pagedserve:8000=1"*) break ;; esac
    sleep 1
done
echo "Prometheus: up{job=\"pagedserve\"}: ${up:-no answer}"
case "$up" in
    *"pagedserve:8000=1"*) pass "Prometheus scrapes pagedserve in the compose stack (up == 1)" ;;
    *) podman logs "${PROJECT}_prometheus_1" 2>&1 | tail -10; fail "Prometheus does not scrape pagedserve (up: ${up:-none})" ;;
esac
rules=$(curl -s -m 5 "http://127.0.0.1:$PROM_PORT/api/v1/rules" | python3 -c 'import json, sys; g = json.load(sys.stdin)["data"]["groups"]; print(sum(len(x["rules"]) for x in g))' 2>/dev/null)
[ "${rules:-0}" -ge 6 ] && pass "Prometheus loaded the $rules alert rules" || fail "alert rules loaded: ${rules:-none}"

# ------------------------------------------------------------------ 7. the gateway profile: a second replica, nginx
log "gateway profile: pagedserve-2 and nginx (built from Debian's package) in front of both replicas"
if ! podman image exists "$NGINX_IMAGE"; then
    podman build --network host --pull=never --format docker -t "$NGINX_IMAGE" -f - . >"$C/nginx-build.log" 2>&1 <<'EOF' \
        || { tail -20 "$C/nginx-build.log"; fail "nginx image build"; }
FROM localhost/debian:bookworm
RUN apt-get update && apt-get install -y --no-install-recommends nginx && rm -rf /var/lib/apt/lists/*
EXPOSE 8080
CMD ["nginx", "-g", "daemon off;"]
EOF
fi
if podman-compose -p "$PROJECT" -f docker-compose.cpu.yml up -d pagedserve-2 gateway >>"$C/compose.log" 2>&1; then
    podman ps --filter "label=io.podman.compose.project=$PROJECT" --format '{{.Names}} {{.Image}} {{.Status}}'
else
    tail -30 "$C/compose.log"
    fail "podman-compose up (gateway profile)"
fi
for _ in $(seq 180); do  # both replicas healthy (the gateway would route around one still loading)
    podman healthcheck run "${PROJECT}_pagedserve-2_1" >/dev/null 2>&1 \
        && podman healthcheck run "${PROJECT}_pagedserve_1" >/dev/null 2>&1 \
        && [ "$(curl -s -o /dev/null -m 10 -w '%{http_code}' "http://127.0.0.1:$GATEWAY_PORT/v1/models")" = 200 ] && break
    sleep 1
done
for index in 1 2 3 4; do
    curl -s -m 60 -o /dev/null -w '%{http_code}\n' "http://127.0.0.1:$GATEWAY_PORT/v1/completions" -H 'Content-Type: application/json' \
        -d "{\"model\": \"$MODEL\", \"prompt\": \"Hello $index\", \"max_tokens\": 4, \"temperature\": 0}"
done > "$C/gateway-codes.txt"
sleep 1
pm logs "${PROJECT}_gateway_1" 2>/dev/null > "$C/gateway-access.log"
python3 - "$C/gateway-codes.txt" "$C/gateway-access.log" <<'EOF' && pass "the gateway balances completions over both replicas (JSON access log)" || fail "the gateway"
import json, sys
codes = open(sys.argv[1]).read().split()
entries = [json.loads(line) for line in open(sys.argv[2]) if line.startswith("{")]
completions = [e for e in entries if e["uri"] == "/v1/completions"]
served = [e["upstream_addr"].split(", ")[-1] for e in completions]  # the last try of each request
print(f"through the gateway: statuses {codes}, served by {served}")
assert codes == ["200"] * 4 and len(completions) == 4 and len(set(served)) == 2
EOF
up=""
for _ in $(seq 60); do
    up=$(curl -s -m 5 "http://127.0.0.1:$PROM_PORT/api/v1/query" --data-urlencode 'query=up{job="pagedserve"}' \
        | python3 -c 'import json, sys; r = json.load(sys.stdin)["data"]["result"]; print(" ".join(sorted(s["metric"]["instance"] + "=" + s["value"][1] for s in r)))' 2>/dev/null)
    [ "$up" = "pagedserve-2:8000=1 pagedserve:8000=1" ] && break
    sleep 1
done
echo "Prometheus: up{job=\"pagedserve\"}: ${up:-no answer}"
[ "$up" = "pagedserve-2:8000=1 pagedserve:8000=1" ] && pass "Prometheus finds and scrapes the second replica (DNS discovery)" \
    || fail "Prometheus and the second replica (up: ${up:-none})"
podman-compose -p "$PROJECT" -f docker-compose.cpu.yml down -v >/dev/null 2>&1
COMPOSE_UP=

# ------------------------------------------------------------------
log "summary"
echo "image: $IMAGE, $((size / 1000000)) MB"
if [ ${#FAILED[@]} -eq 0 ]; then
    echo "all checks passed"
    exit 0
fi
printf 'failed: %s\n' "${FAILED[@]}"
exit 1
