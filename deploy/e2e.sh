#!/usr/bin/env bash
# End-to-end test of the compose stack on a real Docker engine, with no image registry:
# a debootstrap base, images built from it, `up`, health, learner steps, Prometheus
# targets and values, the dashboard's metrics, the rollout queue through server
# reflection, scaling, bad configuration, faults (a worker killed, a worker partitioned,
# the reward server restarted, the learner killed), stop and resume, `down` with the
# final checkpoint kept, and the books of every prompt.
#   deploy/e2e.sh            (release binaries; E2E_PROFILE=dev for a debug build;
#                             E2E_BINARIES=DIR to take DIR's binaries as they are, as CI
#                             does with target/debug after `cargo test --workspace`)
# Exits 0 with "SKIPPED" when no Docker engine answers, 1 when ROOKWORLD_REQUIRE_DOCKER is
# set (CI sets it: there a missing engine is a failure, not a skip). Grafana is not started (its image
# cannot be pulled here); its files are checked by tests/tests/integration/deploy/.
set -euo pipefail
cd "$(dirname "$0")"

if ! docker info >/dev/null 2>&1; then
  if [ -n "${ROOKWORLD_REQUIRE_DOCKER:-}" ]; then
    echo "deploy e2e: FAILED: no Docker engine answers and ROOKWORLD_REQUIRE_DOCKER is set" >&2
    exit 1
  fi
  echo "deploy e2e: SKIPPED (no Docker engine answers)"
  exit 0
fi
if docker compose version >/dev/null 2>&1; then dc=(docker compose); else dc=(docker-compose); fi
project=rwe2e
started=$(date +%s)
say() { echo "[e2e $(( $(date +%s) - started ))s] $*"; }
fail() { echo "deploy e2e: FAILED: $*" >&2; dcp ps >&2 || true; dcp logs --tail 40 >&2 || true; exit 1; }
# TLS mode (compose.tls.yml: mutual TLS on every gRPC connection) unless E2E_TLS=0.
tls="${E2E_TLS:-1}"
files=(-f docker-compose.yml)
[ "$tls" = 1 ] && files+=(-f compose.tls.yml)
dcp() { "${dc[@]}" -p "$project" "${files[@]}" "$@"; }

tmp="$(mktemp -d)"
cleanup() {
  dcp down -v --remove-orphans >/dev/null 2>&1 || true
  rm -rf "$tmp"
}
trap cleanup EXIT
# Stopped from outside (CI's `timeout`): say so, and tear the stack down on the way out.
trap 'echo "deploy e2e: FAILED: stopped by SIGTERM after $(( $(date +%s) - started ))s" >&2; dcp ps >&2 || true; exit 124' TERM

# The stack's settings: a short warm-up, small steps, frequent checkpoints.
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$tmp/token"
chmod 644 "$tmp/token"
export ROOKWORLD_TOKEN_PATH="$tmp/token" TAG=e2e WORKERS=2
scheme=http
if [ "$tls" = 1 ]; then
  scheme=https
  ./tls/make-certs.sh "$tmp/tls" >/dev/null
  chmod 644 "$tmp/tls"/*.crt "$tmp/tls"/*.key   # the services run as uid 10001
  chmod 755 "$tmp/tls"
  export TLS_DIR="$tmp/tls"
fi
export LEARNER_PORT="${E2E_LEARNER_PORT:-25051}" PROMETHEUS_PORT="${E2E_PROMETHEUS_PORT:-29090}"
export LEARNER_STEPS=100000 LEARNER_SFT_STEPS=10 LEARNER_PROMPTS_PER_STEP=4 LEARNER_GROUP_SIZE=4
export LEARNER_CHECKPOINT_EVERY=2 LEARNER_LEASE_TIMEOUT=20 REWARD_ENGINE_PROCESSES=1 REWARD_ENGINE_DEPTH=6
prom="http://127.0.0.1:$PROMETHEUS_PORT"

say "base image (debootstrap + docker import)"
BASE_IMAGE="$(./build-base.sh)"
export BASE_IMAGE
if [ -n "${E2E_BINARIES:-}" ]; then
  say "binaries (already built in $E2E_BINARIES)"
  ./build.sh --from "$E2E_BINARIES" >/dev/null
else
  say "binaries (profile ${E2E_PROFILE:-release})"
  ./build.sh --profile "${E2E_PROFILE:-release}" >/dev/null
fi
say "compose config"
dcp config -q
say "images"
dcp build learner worker reward-server prometheus >/dev/null
docker run --rm --entrypoint promtool "rookworld/prometheus:$TAG" \
  check config /etc/prometheus/prometheus.yml >/dev/null || fail "promtool rejects prometheus.yml (or alerts.yml)"

# Bad configuration: the service exits non-zero with one `error:` line.
one_error_line() { # NAME EXPECTED-TEXT SERVICE ENV...
  local name="$1" expect="$2" service="$3"; shift 3
  local env=() out rc=0
  for e in "$@"; do env+=(-e "$e"); done
  out="$(dcp run --rm --no-deps "${env[@]}" "$service" 2>&1)" || rc=$?
  [ "$rc" -ne 0 ] || fail "$name: exit 0"
  [ "$(grep -c '^error:' <<<"$out")" -eq 1 ] || fail "$name: not one error line: $out"
  grep -q "^error:.*$expect" <<<"$out" || fail "$name: no '$expect' in: $out"
  say "bad config ($name): $(grep '^error:' <<<"$out")"
}
one_error_line "missing token" "token" learner ROOKWORLD_TOKEN_FILE=/run/secrets/none
one_error_line "unreachable reward server" "unreachable" learner \
  LEARNER_REWARD=$scheme://nowhere.invalid:50052 LEARNER_REWARD_WAIT=2
one_error_line "wrong model path" "/models/missing" worker \
  ROOKWORLD_MODEL=/models/missing ROOKWORLD_PRESET=

say "up"
dcp up -d learner worker reward-server prometheus

wait_for() { # SECONDS WHAT COMMAND...
  local deadline=$(( $(date +%s) + $1 )) what="$2"; shift 2
  until "$@"; do
    [ "$(date +%s)" -lt "$deadline" ] || fail "timed out waiting for $what"
    if [ -z "${FAULT:-}" ] && timeout 60 "${dc[@]}" -p "$project" "${files[@]}" ps | grep -qi 'exit'; then
      fail "a container exited while waiting for $what"
    fi
    sleep 3
  done
}
all_healthy_scaled() { # after the scale-up: 6 containers
  local rows
  rows="$(docker ps --filter "label=com.docker.compose.project=$project" --format '{{.Names}} {{.Status}}')"
  [ "$(grep -c . <<<"$rows")" -eq 6 ] && ! grep -qv '(healthy)' <<<"$rows"
}
all_healthy() {
  local rows
  rows="$(docker ps --filter "label=com.docker.compose.project=$project" --format '{{.Names}} {{.Status}}')"
  [ "$(grep -c . <<<"$rows")" -eq 5 ] || return 1
  ! grep -qv '(healthy)' <<<"$rows"
}
wait_for 600 "every service healthy" all_healthy
say "healthy: $(docker ps --filter "label=com.docker.compose.project=$project" --format '{{.Names}}' | sort | tr '\n' ' ')"

query() { # PROMQL -> the first sample's value, or nothing
  curl -fsS -m 20 --get "$prom/api/v1/query" --data-urlencode "query=$1" 2>/dev/null \
    | python3 -c 'import json,sys; r=json.load(sys.stdin)["data"]["result"]; print(r[0]["value"][1] if r else "")' 2>/dev/null || true
}
three_steps() { local v; v="$(query learner_steps_total)"; [ -n "$v" ] && python3 -c "import sys; sys.exit(float('$v') < 3)"; }
wait_for 600 "3 learner steps (learner_steps_total in Prometheus)" three_steps
say "learner steps: $(query learner_steps_total); reward mean $(query learner_reward_mean)"

say "Prometheus targets"
targets_up() { # every job's targets scraped and up (a new target is 'unknown' until then)
  curl -fsS -m 20 "$prom/api/v1/targets" > "$tmp/targets.json" 2>/dev/null || return 1
  python3 - "$tmp/targets.json" <<'PY'
import json, sys
targets = json.load(open(sys.argv[1]))["data"]["activeTargets"]
jobs = {}
for t in targets:
    jobs.setdefault(t["labels"]["job"], []).append(t["health"])
ok = (set(jobs) == {"learner", "reward-server", "rollout-worker", "prometheus"}
      and len(jobs["rollout-worker"]) == 2
      and all(h == "up" for hs in jobs.values() for h in hs))
print("  ", {j: h for j, h in sorted(jobs.items())}, file=sys.stderr if not ok else sys.stdout)
sys.exit(not ok)
PY
}
wait_for 60 "every Prometheus target up" targets_up
[ -n "$(query 'learner_reward_mean')" ] || fail "no learner_reward_mean in Prometheus"
builds="$(query 'count(learner_build_info) + count(reward_build_info) + count(rollout_build_info)')"
[ "$builds" = "4" ] || fail "build_info from every service: $builds of 4"
say "build_info: one series from each of the 4 services' targets"
# The workers share the learner's host: pushes go through the shared tmpfs volume.
shared_pushes() { local v; v="$(query 'sum(learner_weight_pushes_total{path="shared",result="ok"})')"; [ -n "$v" ] && python3 -c "import sys; sys.exit(float('$v') < 1)"; }
wait_for 120 "a weight push through the shared volume" shared_pushes
say "weight pushes: $(query 'sum(learner_weight_pushes_total{path="shared",result="ok"})') through the shared volume, $(query 'sum(learner_weight_pushes_total{path="stream"})') streamed"

# The learner evaluates the start's weights on the held-out suites (LEARNER_EVAL_EVERY).
evaluated() { [ -n "$(query 'learner_eval{suite="checkmate-in-one",metric="mate"}')" ]; }
wait_for 300 "a held-out evaluation (learner_eval in Prometheus)" evaluated
say "evaluation of step $(query learner_eval_step): checkmate-in-one mate $(query 'learner_eval{suite="checkmate-in-one",metric="mate"}'), environment exact FEN $(query 'learner_eval{suite="environment",metric="exact_fen"}')"

say "dashboard metrics exist"
curl -fsS -m 20 "$prom/api/v1/label/__name__/values" > "$tmp/names.json"
python3 - grafana/dashboards/rookworld.json "$tmp/names.json" <<'PY' || fail "dashboard metrics"
import json, re, sys
dash = json.load(open(sys.argv[1]))
names = set(json.load(open(sys.argv[2]))["data"])
used = set()
for p in dash["panels"]:
    for t in p.get("targets", []):
        used |= {m for m in re.findall(r"[a-z_]+", t["expr"])
                 if m.startswith(("learner_", "rollout_", "reward_"))}
# GPU memory only exists on CUDA workers; the sampler/learner gap and the policy's entropy
# are measured on groups with signal, which a random tiny model may not have produced yet.
later = ("rollout_gpu_", "learner_sampler_", "learner_is_", "learner_policy_entropy")
missing = sorted(m for m in used - names if not m.startswith(later))
print(f"   {len(used)} metrics used by the dashboard, missing: {missing}")
assert not missing, missing
PY

say "alert rules loaded"
curl -fsS -m 20 "$prom/api/v1/rules" | grep -q '"name":"LearnerStalled"' || fail "Prometheus has not loaded the LearnerStalled rule"
[ -n "$(query learner_step_idle_seconds)" ] || fail "no learner_step_idle_seconds in Prometheus"

say "rollout queue through server reflection (Python grpcio-reflection)"
python3 -m venv "$tmp/venv"
"$tmp/venv/bin/pip" install -q grpcio grpcio-reflection protobuf
if [ "$tls" = 1 ]; then
  # The operator's certificate, as grpcurl would take it (-cacert, -cert, -key).
  export ROOKWORLD_TLS_CA="$tmp/tls/ca.crt" ROOKWORLD_TLS_CLIENT_CERT="$tmp/tls/operator.crt" \
    ROOKWORLD_TLS_CLIENT_KEY="$tmp/tls/operator.key"
  ! ROOKWORLD_TLS_CA= "$tmp/venv/bin/python" grpc_reflect.py "127.0.0.1:$LEARNER_PORT" list >/dev/null 2>&1 \
    || fail "the learner's queue answered plaintext"
  ! ROOKWORLD_TLS_CLIENT_CERT= ROOKWORLD_TLS_CLIENT_KEY= "$tmp/venv/bin/python" grpc_reflect.py \
    "127.0.0.1:$LEARNER_PORT" list >/dev/null 2>&1 || fail "the learner's queue answered a client without a certificate"
  say "TLS: plaintext and a client without a certificate are refused; the operator's certificate is taken"
fi
# Bounded: the reflection stream has no deadline of its own, and a learner that is being
# restarted must make a probe fail, not hang the run.
reflect() { timeout 30 "$tmp/venv/bin/python" grpc_reflect.py "127.0.0.1:$LEARNER_PORT" "$@"; }
reflect list > "$tmp/services"
grep -qx rookworld.queue.v1.RolloutQueue "$tmp/services" || fail "reflection does not list the queue: $(cat "$tmp/services")"
grep -qx grpc.health.v1.Health "$tmp/services" || fail "reflection does not list health"
reflect call rookworld.queue.v1.RolloutQueue/GetDepths '{}' | tr -d '\n' | sed 's/  */ /g'; echo
reflect call rookworld.queue.v1.RolloutQueue/ListWorkers '{}' > "$tmp/workers.json"
python3 -c "import json,sys; w=json.load(open(sys.argv[1])).get('workers',[]); print('   workers:', len(w)); sys.exit(len(w) < 2)" "$tmp/workers.json" \
  || fail "ListWorkers: $(cat "$tmp/workers.json")"
has_groups() {
  reflect call rookworld.queue.v1.RolloutQueue/PeekGroups '{"count": 4}' > "$tmp/groups.json" 2>/dev/null \
    && python3 -c "import json,sys; sys.exit(not json.load(open(sys.argv[1])).get('groups'))" "$tmp/groups.json"
}
wait_for 120 "PeekGroups to return groups" has_groups
python3 -c "
import json,sys; g=json.load(open(sys.argv[1]))['groups']
print('   PeekGroups:', len(g), 'groups; first:', g[0]['worker_id'], 'version', g[0].get('weight_version', '0'), repr(g[0]['prompt'][:40]))" "$tmp/groups.json"

say "scale to 3 workers: they register, Prometheus finds the third by DNS"
dcp up -d --no-recreate --scale worker=3 worker 2>&1 | grep -v '^Creating\|is up-to-date' || true
three_workers() {
  reflect call rookworld.queue.v1.RolloutQueue/ListWorkers '{}' > "$tmp/workers.json" 2>/dev/null \
    && python3 -c "import json,sys; sys.exit(len(json.load(open(sys.argv[1])).get('workers',[])) < 3)" "$tmp/workers.json" \
    && [ "$(query 'count(up{job="rollout-worker"} == 1)')" = 3 ]
}
wait_for 180 "a third worker registered and scraped" three_workers
say "   workers: 3 registered, 3 rollout-worker targets up"

# Faults on the engine (the loopback fault tests in tests/tests/integration/faults cover the same with
# assertions on every lease; here the real images, restart policies and network).
container() { # SERVICE NUMBER -> container id
  docker ps -aq --filter "label=com.docker.compose.project=$project" \
    --filter "label=com.docker.compose.service=$1" --filter "label=com.docker.compose.container-number=$2"
}
depth() { # FIELD of GetDepths (0 when absent or the learner does not answer)
  reflect call rookworld.queue.v1.RolloutQueue/GetDepths '{}' 2>/dev/null \
    | python3 -c "import json,sys; print(json.load(sys.stdin).get('$1', 0))" 2>/dev/null || echo 0
}
worker_field() { # HOSTNAME FIELD of the learner's ListWorkers entry for that worker
  reflect call rookworld.queue.v1.RolloutQueue/ListWorkers '{}' 2>/dev/null | python3 -c "
import json,sys
for w in json.load(sys.stdin).get('workers', []):
    if w['worker_id'].startswith('$1:'): print(w.get('$2', 0)); break
else: print(-1)" 2>/dev/null || echo -1
}
# A crash, not a stop: SIGKILL from the host to the container's first process (a `docker
# kill` counts as a manual stop, after which Docker does not apply the restart policy).
crash() { # CONTAINER
  local pid sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  pid="$(docker inspect -f '{{.State.Pid}}' "$1")"
  $sudo kill -KILL "$pid"
}
advanced() { [ "$(depth learner_version)" -ge "$1" ]; }
submits_at() { # HOSTNAME VERSION: the worker submitted a group of at least VERSION
  [ "$(worker_field "$1" weight_version)" -ge "$2" ]
}

say "fault: kill -9 a worker's process; its restart policy brings it back, it re-syncs"
victim="$(container worker 3)"
host="$(docker inspect -f '{{.Config.Hostname}}' "$victim")"
at="$(depth learner_version)" expired="$(depth leases_expired)"
export FAULT=1
running() { [ "$(docker inspect -f '{{.State.Running}}' "$victim")" = true ]; }
held=0
for attempt in 1 2 3; do # mid-generation: while it holds a lease (the learner's view)
  for _ in $(seq 60); do
    [ "$(worker_field "$host" outstanding)" -gt 0 ] && break
    sleep 0.5
  done
  crash "$victim"
  held="$(worker_field "$host" outstanding)"
  [ "$held" -gt 0 ] && break
  say "   attempt $attempt: it had just submitted; again once it is back"
  sleep 2
  wait_for 120 "the killed worker to be restarted" running
done
wait_for 120 "training to go on without it" advanced $((at + 3))
more_expired() { [ "$(depth leases_expired)" -ge $((expired + held)) ]; }
if [ "$held" -gt 0 ]; then
  wait_for 120 "the killed worker's $held leases to expire (LEARNER_LEASE_TIMEOUT=20)" more_expired
else
  say "   it held no lease when killed (it submitted in between)"
fi
wait_for 120 "the killed worker to be restarted" running
at="$(depth learner_version)"
wait_for 180 "the restarted worker to submit on current weights" submits_at "$host" "$((at - 2))"
say "   restarts: $(docker inspect -f '{{.RestartCount}}' "$victim"); it held $held leases, leases expired: $expired -> $(depth leases_expired); it submits on version $(worker_field "$host" weight_version) (learner at $(depth learner_version))"

say "fault: partition a worker from the network and heal it"
victim="$(container worker 1)"
host="$(docker inspect -f '{{.Config.Hostname}}' "$victim")"
docker network disconnect "${project}_default" "$victim"
at="$(depth learner_version)"
wait_for 120 "training to go on without it" advanced $((at + 3))
docker network connect --alias worker --alias "$host" "${project}_default" "$victim"
at="$(depth learner_version)"
wait_for 180 "the healed worker to submit on current weights" submits_at "$host" "$((at - 2))"
say "   healed; it submits on version $(worker_field "$host" weight_version) (learner at $(depth learner_version))"

say "fault: restart the reward server"
at="$(depth learner_version)"
docker restart "$(container reward-server 1)" >/dev/null
wait_for 180 "training to go on after the restart" advanced $((at + 3))

say "fault: kill -9 the learner's process; its restart policy resumes it from its checkpoint"
# The learner's log as a file: `grep -q` on a pipe would end `dcp logs` early (SIGPIPE,
# a failure under pipefail).
learner_log() { timeout 60 "${dc[@]}" -p "$project" "${files[@]}" logs --no-color learner > "$tmp/learner.log" 2>&1 || true; cat "$tmp/learner.log"; }
resumes="$(learner_log | grep -c 'prepare: resumed ' || true)"
at="$(depth learner_version)"
crash "$(container learner 1)"
more_resumes() { [ "$(learner_log | grep -c 'prepare: resumed ' || true)" -gt "$resumes" ]; }
wait_for 180 "the learner to be restarted and resume" more_resumes
learner_log | grep 'prepare: resumed ' | tail -1 | sed 's/^[^|]*| */   /'
wait_for 180 "training to go on after the resume" advanced $((at + 3))
at="$(depth learner_version)"
wait_for 180 "a worker to submit on the resumed learner's weights" submits_at \
  "$(docker inspect -f '{{.Config.Hostname}}' "$(container worker 2)")" "$((at - 2))"
unset FAULT
wait_for 120 "every service healthy again" all_healthy_scaled

say "stop (the learner drains and writes its final checkpoint)"
# The resumed learner's counter starts anew: wait until Prometheus has scraped it.
steps_seen() { [ -n "$(query learner_steps_total)" ]; }
wait_for 60 "Prometheus to scrape the resumed learner's steps" steps_seen
steps_before="$(query learner_steps_total)"
dcp stop learner
code="$(docker inspect --format '{{.State.ExitCode}}' "$(dcp ps -q learner)")"
[ "$code" = 0 ] || fail "learner exit code $code after SIGTERM"
learner_log >/dev/null; grep -q "checkpoint written; stopping" "$tmp/learner.log" || fail "no final checkpoint line in the learner's log"
checkpoint_step() { # -> the step of the latest checkpoint in the volume
  docker run --rm -v "${project}_checkpoints:/data/run" --entrypoint sh "rookworld/learner:$TAG" -c \
    'cat /data/run/checkpoints/$(cat /data/run/checkpoints/latest)/trainer_state.json' \
    | python3 -c 'import json,sys; print(json.load(sys.stdin)["step"])'
}
stopped_at="$(checkpoint_step)" || fail "no final checkpoint in the checkpoints volume"
python3 -c "import sys; sys.exit(not int(sys.argv[1]) >= max(3, int(float(sys.argv[2]))))" \
  "$stopped_at" "$steps_before" || fail "final checkpoint at step $stopped_at, Prometheus saw $steps_before"
say "   final checkpoint: step $stopped_at (Prometheus had seen $steps_before)"

say "resume (the same volume, LEARNER_RESUME=true; the workers still running re-register)"
dcp start learner
resumed() { learner_log >/dev/null; grep -q "prepare: resumed step=$stopped_at " "$tmp/learner.log"; }
wait_for 120 "the learner's 'resumed' line at step $stopped_at" resumed
next_step() { learner_log >/dev/null; grep -q "step=$((stopped_at + 1)) reward_mean" "$tmp/learner.log"; }
wait_for 300 "step $((stopped_at + 1)) after the resume" next_step
say "   resumed at step $stopped_at, trained step $((stopped_at + 1))"

say "down (the learner's final checkpoint stays in its volume)"
dcp down
final="$(checkpoint_step)" || fail "no final checkpoint after down"
[ "$final" -gt "$stopped_at" ] || fail "final checkpoint at step $final, not after $stopped_at"
say "   final checkpoint: step $final"

say "the books: every prompt consumed once, dropped and counted, or kept in the checkpoint"
docker run --rm -v "${project}_checkpoints:/data/run" -v "${project}_rollouts:/data/rollouts" \
  --entrypoint sh "rookworld/learner:$TAG" -c \
  'cat /data/run/checkpoints/$(cat /data/run/checkpoints/latest)/trainer_state.json; echo; echo "# dump"; cat /data/rollouts/groups.jsonl' \
  > "$tmp/books.txt" || fail "cannot read the volumes"
python3 - "$tmp/books.txt" <<'PY' || fail "the books do not balance"
import json, sys
state_text, dump = open(sys.argv[1]).read().split("\n# dump\n", 1)
state = json.loads(state_text)
q, c = state["queue"], state["queue"]["counters"]
consumed = [json.loads(l)["prompt_id"] for l in dump.split("\n") if l.strip()]
unfinished = {p["id"] for p in q["unfinished"]}
assert len(consumed) == len(set(consumed)), "a prompt consumed twice"
assert not unfinished & set(consumed), "a consumed prompt kept as unfinished"
assert len(consumed) == c["groups_consumed"], (len(consumed), c)
issued = q["next_prompt_id"]
assert issued == c["prompts_added"] == len(consumed) + c["groups_dropped_stale"] + len(unfinished), (issued, c)
print(f"   {issued} prompts: {len(consumed)} consumed, {c['groups_dropped_stale']} dropped (counted), "
      f"{len(unfinished)} kept; {c['leases_expired']} leases expired and re-issued")
PY
say "PASSED"
