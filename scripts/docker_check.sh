#!/usr/bin/env bash
# Build the Docker image and run two peers of it, on a machine with no container registry.
#
#   sudo scripts/docker_check.sh [--out FILE] [--rebuild-base] [--keep-image]
#
# Slow (minutes; the first run downloads ~2.8 GB of torch and its CUDA wheels) and run by hand,
# not by the test suite; docs/deploy.md has the figures. As root, it:
#   1. installs docker.io and debootstrap (apt) if missing, and starts
#      `dockerd --iptables=false --bridge=none` if no daemon answers (stopped again at the end);
#   2. builds a base image with no registry: Debian bookworm (debootstrap, minbase), python3 with
#      its headers in a venv first on PATH, this host's extra CA certificates, and PyPI's
#      torch==2.13.0 (a CUDA build); kept between runs, replaced only with --rebuild-base;
#   3. builds the project's image on it (--build-arg BASE_IMAGE=…, no layer cache);
#   4. runs two containers with --network host on 127.0.0.1, each on its own port and volume, the
#      second bootstrapping from the first's address, and checks that both merge, that both turn
#      healthy, and that `docker exec <container> murmur status` answers;
#   5. stops and removes what it started (containers, volumes, the project image unless
#      --keep-image, the daemon) and prints, and writes to FILE, a JSON of sizes and times.
# Exits 0 if every check passed, 1 with a line saying which failed, 2 on a bad argument.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT="$ROOT/results/docker_check.json"
REBUILD_BASE=0
KEEP_IMAGE=0
while (($#)); do
    case "$1" in
        --out) OUT=${2:?--out needs a file}; shift 2 ;;
        --rebuild-base) REBUILD_BASE=1; shift ;;
        --keep-image) KEEP_IMAGE=1; shift ;;
        -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "docker_check: unknown argument $1 (--help for the options)" >&2; exit 2 ;;
    esac
done

TORCH_VERSION=2.13.0
DEBIAN_IMAGE=murmur-check/debian:bookworm
BASE_IMAGE=murmur-check/python-torch:$TORCH_VERSION
IMAGE=murmur-check/murmur:$$
NAME=murmur-check-$$
WAIT_S=300 # the longest any one wait below may take
export DOCKER_BUILDKIT=0 # the classic builder: BuildKit in docker.io 20.10 has no --network host for RUN

STARTED=() # containers
VOLUMES=()
DOCKERD_PID=
WORK=$(mktemp -d "${TMPDIR:-/tmp}/murmur-docker-check.XXXXXX")
LOAD_AT_START=$(cut -d' ' -f1-3 /proc/loadavg) # other work on the host slows every figure below

say() { echo "docker_check: $*" >&2; }
fail() {
    say "FAILED: $*"
    exit 1
}
now() { date +%s.%N; }
since() { python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 1))" "$1" "$(now)"; }

alive() { # a zombie (state Z) has ended; its parent, this script, has not waited for it yet
    local state
    state=$(cut -d' ' -f3 "/proc/$1/stat" 2>/dev/null) && [[ -n $state && $state != Z ]]
}

cleanup() {
    local code=$?
    set +e
    for c in "${STARTED[@]}"; do docker rm -f "$c" >/dev/null 2>&1; done
    for v in "${VOLUMES[@]}"; do docker volume rm "$v" >/dev/null 2>&1; done
    if ((!KEEP_IMAGE)); then docker image rm "$IMAGE" >/dev/null 2>&1; fi
    if [[ -n $DOCKERD_PID ]]; then
        kill "$DOCKERD_PID" 2>/dev/null
        for _ in $(seq 60); do alive "$DOCKERD_PID" || break; sleep 0.5; done
        if alive "$DOCKERD_PID"; then
            say "dockerd ($DOCKERD_PID) did not stop within 30 s of SIGTERM: killing it"
            kill -KILL "$DOCKERD_PID" 2>/dev/null
        fi
        wait "$DOCKERD_PID" 2>/dev/null
    fi
    rm -rf "$WORK"
    exit "$code"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- 1. tools and the daemon ------------------------------------------------------------------

[[ $(id -u) == 0 ]] || fail "run it as root: it installs packages and starts dockerd"
command -v python3 >/dev/null || fail "python3 is needed on the host (it reads the JSON that murmur status prints)"
missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if ((${#missing[@]})); then
    say "installing ${missing[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
if ! docker info >/dev/null 2>&1; then
    say "starting dockerd --iptables=false --bridge=none (it leaves the host's firewall and bridges alone)"
    dockerd --iptables=false --bridge=none >"$WORK/dockerd.log" 2>&1 &
    DOCKERD_PID=$!
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || fail "dockerd did not answer within 60 s: $(tail -3 "$WORK/dockerd.log")"
fi

# --- 2. the base image ------------------------------------------------------------------------

base_build_s=null # null: the cached base image was reused
debootstrap_s=null
if ((REBUILD_BASE)) || ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    docker image rm "$BASE_IMAGE" >/dev/null 2>&1 || true # --rebuild-base: not left behind as a dangling 5 GB image
    say "building $BASE_IMAGE (debootstrap, python3, torch==$TORCH_VERSION from PyPI: a few minutes)"
    t0=$(now)
    debootstrap --variant=minbase bookworm "$WORK/rootfs" http://deb.debian.org/debian >"$WORK/debootstrap.log" 2>&1 ||
        fail "debootstrap: $(tail -3 "$WORK/debootstrap.log")"
    rm -f "$WORK"/rootfs/var/cache/apt/archives/*.deb
    tar -C "$WORK/rootfs" -c . | docker import - "$DEBIAN_IMAGE" >/dev/null
    rm -rf "$WORK/rootfs"
    debootstrap_s=$(since "$t0")
    mkdir "$WORK/base" "$WORK/base/ca"
    # Certificates this host added to its store (a TLS-inspecting proxy's, say): without them pip in the
    # build cannot reach PyPI here. An image holding them is for local checks only.
    find /usr/local/share/ca-certificates -name '*.crt' -exec cp {} "$WORK/base/ca/" \; 2>/dev/null || true
    cat >"$WORK/base/Dockerfile" <<EOF
FROM $DEBIAN_IMAGE
COPY ca/ /usr/local/share/ca-certificates/
# python3-dev: fastecdsa (a py-libp2p dependency) compiles against Python.h. Debian's python3 refuses
# pip installs, so a venv comes first on PATH, with python and pip as the pytorch/pytorch image has them.
RUN apt-get update \\
    && apt-get install -y --no-install-recommends ca-certificates python3 python3-dev python3-venv \\
    && update-ca-certificates \\
    && apt-get clean \\
    && rm -rf /var/lib/apt/lists/* \\
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:\$PATH \\
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \\
    PIP_NO_CACHE_DIR=1
RUN pip install torch==$TORCH_VERSION
EOF
    docker build --network host -t "$BASE_IMAGE" "$WORK/base" >"$WORK/base.log" 2>&1 ||
        fail "building $BASE_IMAGE: $(tail -5 "$WORK/base.log")"
    docker image rm "$DEBIAN_IMAGE" >/dev/null # its layer lives on in the base image
    base_build_s=$(since "$t0")
    say "base image built in ${base_build_s} s"
else
    say "reusing $BASE_IMAGE (--rebuild-base to build it again)"
fi

# --- 3. the project's image -------------------------------------------------------------------

say "building the project's image on $BASE_IMAGE"
t0=$(now)
docker build --network host --no-cache --build-arg "BASE_IMAGE=$BASE_IMAGE" -t "$IMAGE" "$ROOT" >"$WORK/build.log" 2>&1 ||
    fail "docker build: $(tail -5 "$WORK/build.log")"
project_build_s=$(since "$t0")
say "project image built in ${project_build_s} s"
packages() {
    docker run --rm --network none --entrypoint dpkg-query "$1" -W -f '${db:Status-Status} ${binary:Package}\n' |
        awk '$1 == "installed" {print $2}' | sort
}
left=$(comm -13 <(packages "$BASE_IMAGE") <(packages "$IMAGE") | sed '/^libgmp10/d')
[[ -z $left ]] || fail "the build left packages behind that only it needed: ${left//$'\n'/ }"

# --- 4. two peers -----------------------------------------------------------------------------

free_port() { python3 -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
status_json() { docker exec "$1" murmur status --json 2>/dev/null; }
merged() { status_json "$1" | python3 -c "import json, sys; print(json.load(sys.stdin)['exchanges'].get('merged', 0))" 2>/dev/null || echo 0; }
health() { docker inspect --format '{{.State.Health.Status}}' "$1"; }

# The image's own ENTRYPOINT, listening on 127.0.0.1 instead of every interface: with --network host
# two containers cannot both take port 4001.
read -r -a entrypoint < <(docker image inspect --format '{{range .Config.Entrypoint}}{{.}} {{end}}' "$IMAGE")
[[ ${entrypoint[*]:0:2} == "murmur run" ]] || fail "the image's ENTRYPOINT is not murmur run: ${entrypoint[*]}"
start_peer() { # name port [murmur run options…]
    local name=$1 port=$2 args=()
    shift 2
    for arg in "${entrypoint[@]:1}"; do args+=("${arg//\/ip4\/0.0.0.0\/tcp\/4001//ip4/127.0.0.1/tcp/$port}"); done
    VOLUMES+=("$name")
    STARTED+=("$name")
    docker run -d --name "$name" --network host -v "$name:/data" --entrypoint murmur "$IMAGE" \
        "${args[@]}" --addr-file /data/addrs "$@" >/dev/null
}

port_a=$(free_port)
port_b=$(free_port)
[[ $port_a != "$port_b" ]] || port_b=$(free_port)
say "starting two peers on 127.0.0.1:$port_a and 127.0.0.1:$port_b"
t0=$(now)
start_peer "$NAME-a" "$port_a"
addr=
for _ in $(seq "$WAIT_S"); do
    addr=$(docker exec "$NAME-a" head -1 /data/addrs 2>/dev/null) && [[ -n $addr ]] && break
    [[ $(docker inspect --format '{{.State.Running}}' "$NAME-a") == true ]] || fail "$NAME-a exited: $(docker logs --tail 5 "$NAME-a" 2>&1)"
    sleep 1
done
[[ $addr == /ip4/127.0.0.1/tcp/$port_a/p2p/* ]] || fail "$NAME-a wrote no address on port $port_a: '$addr'"
start_peer "$NAME-b" "$port_b" --bootstrap "$addr"
merged_a=0 merged_b=0
for _ in $(seq "$WAIT_S"); do
    merged_a=$(merged "$NAME-a") merged_b=$(merged "$NAME-b")
    ((merged_a > 0 && merged_b > 0)) && break
    sleep 1
done
((merged_a > 0 && merged_b > 0)) || fail "no merges within ${WAIT_S} s (a: $merged_a, b: $merged_b)"
first_merge_s=$(since "$t0")
say "both peers merged ${first_merge_s} s after the first docker run"

# The HEALTHCHECK runs as the image defines it: its first check comes one interval after the start.
for c in "$NAME-a" "$NAME-b"; do
    for _ in $(seq "$WAIT_S"); do [[ $(health "$c") == healthy ]] && break; sleep 1; done
    [[ $(health "$c") == healthy ]] || fail "$c is $(health "$c"), not healthy: $(docker inspect --format '{{json .State.Health.Log}}' "$c")"
done
healthy_s=$(since "$t0")
say "both containers healthy ${healthy_s} s after the first docker run"

table=$(docker exec "$NAME-a" murmur status) || fail "docker exec $NAME-a murmur status failed"
if ! grep -q "peer ID" <<<"$table" || ! grep -q "merged" <<<"$table"; then
    fail "murmur status shows no peer ID or merges: $table"
fi

# What a health check costs while both peers train: its own wall time, and, for scale, importing torch.
health_s=()
for _ in 1 2 3 4 5; do
    t=$(now)
    docker exec "$NAME-b" murmur status --health >/dev/null || fail "murmur status --health failed in $NAME-b"
    health_s+=("$(since "$t")")
done
torch_s=()
for _ in 1 2 3; do
    t=$(now)
    docker exec "$NAME-b" python -c "import torch" || fail "importing torch failed in $NAME-b"
    torch_s+=("$(since "$t")")
done
total_merged=$(merged "$NAME-a")

for c in "$NAME-a" "$NAME-b"; do
    docker stop --time 60 "$c" >/dev/null
    code=$(docker inspect --format '{{.State.ExitCode}}' "$c")
    [[ $code == 0 ]] || fail "$c exited $code on docker stop (a graceful stop exits 0): $(docker logs --tail 5 "$c" 2>&1)"
done

# --- 5. the figures ---------------------------------------------------------------------------

join() {
    local IFS=,
    echo "[$*]"
}
docker inspect --format '{{json .State.Health.Log}}' "$NAME-a" >"$WORK/healthchecks.json"
mkdir -p "$(dirname "$OUT")"
# name=value pairs; each value is JSON (a number, null, a list) or else a string.
python3 - "$OUT" "$WORK/healthchecks.json" \
    image="$IMAGE" base_image="$BASE_IMAGE" \
    image_bytes="$(docker image inspect --format '{{.Size}}' "$IMAGE")" \
    base_image_bytes="$(docker image inspect --format '{{.Size}}' "$BASE_IMAGE")" \
    base_build_s="$base_build_s" base_debootstrap_and_import_s="$debootstrap_s" \
    project_build_s="$project_build_s" run_to_first_merge_s="$first_merge_s" run_to_both_healthy_s="$healthy_s" \
    merged_exchanges_peer_a="$total_merged" \
    status_health_under_load_s="$(join "${health_s[@]}")" import_torch_under_load_s="$(join "${torch_s[@]}")" \
    cpus="$(nproc)" load_average_at_start="$LOAD_AT_START" load_average_at_end="$(cut -d' ' -f1-3 /proc/loadavg)" <<'EOF'
import json, re, sys
from datetime import datetime

def value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text

def seconds(stamp: str) -> float:  # RFC 3339 with nanoseconds; fromisoformat takes microseconds
    return datetime.fromisoformat(re.sub(r"(\.\d{6})\d*", r"\1", stamp).replace("Z", "+00:00")).timestamp()

out, checks_file, *pairs = sys.argv[1:]
report = {name: value(text) for name, _, text in (pair.partition("=") for pair in pairs)}
with open(checks_file) as f:
    checks = json.load(f) or []
for name in ("image", "base_image"):
    report[f"{name}_size_gb"] = round(report[f"{name}_bytes"] / 1e9, 2)
report["healthcheck_runs_s"] = [round(seconds(c["End"]) - seconds(c["Start"]), 2) for c in checks]
text = json.dumps(report, indent=1)
with open(out, "w") as f:
    f.write(text + "\n")
print(text)
EOF
say "all checks passed; figures in $OUT"
