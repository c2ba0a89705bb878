#!/usr/bin/env bash
# End-to-end on a kind cluster, the way a platform team uses dropgate: the chart
# installed with defaults plus Secrets, a shop Deployment (3 replicas) labelled
# `dropgate.io/inject: "true"` that the webhook injects the sidecar into, PostgreSQL
# as the replicas' shared ledger. A drop applied with kubectl is sold out by 150
# buyers spread over the replicas (curl to 127.0.0.1:7070 inside each pod), and
# Redis (redis-cli) and the ledger (psql) show that no more than the limit was sold;
# then the kill switch moves the sidecars to the ledger's fallback gate, which sells
# nothing more either, and deleting the drop removes its Redis keys.
# Needs Docker (a running engine), kind, kubectl and helm; skips in one line where
# they are not. KEEP=1 keeps the cluster afterwards.
set -euo pipefail
cd "$(dirname "$0")/../.."

skip() { echo "e2e/kind: SKIPPED: $*" >&2; exit 0; }
for tool in docker kind kubectl helm; do
  command -v "$tool" >/dev/null 2>&1 || skip "$tool is not installed"
done
docker info >/dev/null 2>&1 || skip "no Docker engine is running (docker info failed)"

cluster=dropgate-e2e
ns=shop
operator_ns=dropgate-system
drop=sneaker-0412
limit=100
buyers=150
keys="dropgate:{$ns/$drop}"
fail() {
  echo "e2e/kind: FAILED: $*" >&2
  kubectl -n "$operator_ns" logs deploy/dropgate-operator --tail=50 >&2 || true
  kubectl -n "$ns" logs deploy/shop -c dropgate-sidecar --tail=50 >&2 || true
  kubectl -n "$ns" get events --sort-by=.lastTimestamp 2>/dev/null | tail -20 >&2 || true
  exit 1
}
cleanup() { [ "${KEEP:-0}" = 1 ] || kind delete cluster --name "$cluster" >/dev/null 2>&1 || true; }
trap cleanup EXIT
# poll SECONDS COMMAND...: until the command succeeds.
poll() {
  local deadline=$(($(date +%s) + $1))
  shift
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$deadline" ] || return 1
    sleep 2
  done
}
field() { kubectl -n "$ns" get "idrop/$drop" -o "jsonpath={$1}"; }
field_is() { [ "$(field "$1")" = "$2" ]; }
redis() { kubectl -n "$ns" exec deploy/redis -- redis-cli "$@"; }
psql_ledger() { kubectl -n "$ns" exec deploy/postgres -- psql -U dropgate -d dropgate -tAc "$1"; }

kind get clusters | grep -qx "$cluster" || kind create cluster --name "$cluster" --wait 120s
docker build -t dropgate:e2e .
kind load docker-image dropgate:e2e --name "$cluster"

# The shop's namespace: Redis, PostgreSQL, and the two Secrets the injected sidecars
# read (their names are the chart's sidecar.redis / sidecar.database values).
kubectl create namespace "$ns" --dry-run=client -o yaml | kubectl apply -f -
kubectl apply -f e2e/kind/redis.yaml -f e2e/kind/postgres.yaml
kubectl -n "$ns" create secret generic dropgate-redis --from-literal=url="redis://redis.$ns:6379" \
  --dry-run=client -o yaml | kubectl apply -f -
kubectl -n "$ns" rollout status deploy/redis --timeout=120s
kubectl -n "$ns" rollout status deploy/postgres --timeout=180s

# The chart: defaults, plus the image under test and the shared ledger's Secret.
helm upgrade --install dropgate charts/dropgate --namespace "$operator_ns" --create-namespace \
  --set image.tag=e2e --set image.pullPolicy=Never --set operator.resyncSeconds=5 \
  --set sidecar.database.existingSecret=dropgate-ledger --wait --timeout 180s

sed "s#redis://redis:6379#redis://redis.$ns:6379#" examples/drop.yaml | kubectl apply -f -
kubectl -n "$ns" wait --for=condition=Ready "inventorydrop/$drop" --timeout=120s || fail "the drop never became Ready"
kubectl -n "$ns" get idrop
field_is .status.remaining "$limit" || fail "status.remaining is not $limit"
field .metadata.finalizers | grep -q dropgate.io/cleanup || fail "no finalizer"

# Injection: what the API server stores for a labelled pod and for an unlabelled one.
pod_json() { # NAME LABELS: a pod, created with a server-side dry run (webhooks run, nothing is stored)
  kubectl -n "$ns" run "$1" --image=curlimages/curl:8.10.1 --restart=Never --labels="$2" \
    --dry-run=server -o jsonpath='{.spec.initContainers[*].name}'
}
[ "$(pod_json probe-labelled 'dropgate.io/inject=true')" = dropgate-sidecar ] \
  || fail "a pod labelled dropgate.io/inject=true was not injected"
[ -z "$(pod_json probe-plain 'app=plain')" ] || fail "an unlabelled pod was injected"

# The shop: 3 replicas, each with its injected sidecar, all Ready.
kubectl apply -f e2e/kind/buyers.yaml
kubectl -n "$ns" rollout status deploy/shop --timeout=180s || fail "the shop's injected pods did not become Ready"
mapfile -t pods < <(kubectl -n "$ns" get pods -l app=shop -o name)
[ "${#pods[@]}" = 3 ] || fail "${#pods[@]} shop pods, want 3"
for pod in "${pods[@]}"; do
  sidecars=$(kubectl -n "$ns" get "$pod" -o jsonpath='{.spec.initContainers[?(@.restartPolicy=="Always")].name}')
  [ "$sidecars" = dropgate-sidecar ] || fail "$pod has no native sidecar dropgate-sidecar (init containers: $sidecars)"
  kubectl -n "$ns" get "$pod" -o jsonpath='{.metadata.annotations}' | grep -q 'dropgate.io/injected' \
    || fail "$pod is not annotated dropgate.io/injected"
done

# The sale: buyer i buys through replica i mod 3, all replicas at once; each pod
# prints how many of its buyers were admitted (201), and confirms them.
sell() { # POD FIRST: buyers FIRST, FIRST+3, ... up to $buyers
  kubectl -n "$ns" exec "$1" -c shop -- sh -c '
    admitted=0 i=$1
    while [ "$i" -le "$2" ]; do
      code=$(curl -s -o /dev/null -w "%{http_code}" -XPOST -H "Content-Type: application/json" \
        "http://127.0.0.1:7070/v1/drops/$3/reservations" \
        -d "{\"key\":\"order-$i\",\"user\":\"buyer-$i\",\"quantity\":1}")
      if [ "$code" = 201 ]; then
        admitted=$((admitted + 1))
        curl -s -o /dev/null -XPOST "http://127.0.0.1:7070/v1/drops/$3/reservations/order-$i/confirm"
      fi
      i=$((i + 3))
    done
    echo "admitted=$admitted"' sell "$2" "$buyers" "$drop"
}
tmp=$(mktemp -d)
for i in 0 1 2; do
  sell "${pods[$i]}" $((i + 1)) >"$tmp/sale-$i" 2>&1 &
done
wait
admitted=0
for i in 0 1 2; do
  n=$(sed -n 's/^admitted=//p' "$tmp/sale-$i")
  [ -n "$n" ] || fail "the sale through ${pods[$i]} did not finish: $(cat "$tmp/sale-$i")"
  echo "e2e/kind: ${pods[$i]} admitted $n"
  admitted=$((admitted + n))
done
rm -rf "$tmp"
[ "$admitted" -le "$limit" ] || fail "OVERSOLD: $admitted of $limit units admitted to $buyers buyers"
[ "$admitted" = "$limit" ] || fail "admitted $admitted of $limit units to $buyers buyers (want all $limit sold)"

# What Redis and the ledger hold: never more than the limit.
remaining=$(redis GET "$keys:remaining")
[ "$remaining" = 0 ] || fail "Redis $keys:remaining is $remaining, want 0"
markers=$(redis --scan --pattern "$keys:res:*" | wc -l)
[ "$markers" -le "$limit" ] || fail "OVERSOLD: $markers reservations in Redis for $limit units"
sold_in_ledger() {
  psql_ledger "SELECT COALESCE(SUM(quantity), 0) FROM reservations
               WHERE drop_key LIKE '$ns/$drop%' AND state IN ('active', 'confirmed')"
}
ledger_caught_up() { [ "$(sold_in_ledger)" = "$admitted" ]; }
poll 60 ledger_caught_up || true
sold=$(sold_in_ledger)
[ "$sold" -le "$limit" ] || fail "OVERSOLD: the ledger holds $sold units for $limit"
[ "$sold" = "$admitted" ] || fail "the ledger holds $sold units, the buyers were admitted $admitted"
poll 60 field_is .status.phase SoldOut || fail "phase is $(field .status.phase), not SoldOut"
echo "e2e/kind: sold $admitted of $limit to $buyers buyers over ${#pods[@]} replicas; Redis remaining $remaining, ledger $sold"

# The kill switch: every sidecar moves to the ledger's fallback gate, which the
# shared PostgreSQL keeps at 0 too: nothing more is sold.
kubectl -n "$ns" patch idrop "$drop" --type merge -p '{"spec":{"gate":{"enabled":false}}}'
poll 60 field_is .status.mode fail-open || fail "the kill switch did not reach status"
kubectl -n "$ns" get events --field-selector reason=FailOpenEnabled -o name | grep -q . || fail "no FailOpenEnabled Event"
for pod in "${pods[@]}"; do
  poll 60 sh -c "kubectl -n $ns exec $pod -c shop -- curl -sf http://127.0.0.1:7070/v1/drops/$drop | grep -q '\"mode\":\"fail-open\"'" \
    || fail "$pod's sidecar is not on the fallback path"
  answer=$(kubectl -n "$ns" exec "$pod" -c shop -- curl -s -i -XPOST -H "Content-Type: application/json" \
    "http://127.0.0.1:7070/v1/drops/$drop/reservations" -d "{\"key\":\"late-$pod\",\"user\":\"late-$pod\",\"quantity\":1}" | tr -d '\r')
  echo "$answer" | head -1 | grep -q ' 409' || fail "the fallback through $pod admitted a unit past the limit: $answer"
  echo "$answer" | grep -qi '^dropgate-path: fallback' || fail "$pod answered from the gate, not the fallback: $answer"
done
[ "$(sold_in_ledger)" = "$admitted" ] || fail "the fallback changed what the ledger holds: $(sold_in_ledger)"

# Deletion: the shop stops first (nothing writes the drop's keys again), then the
# finalizer removes them.
kubectl -n "$ns" scale deploy/shop --replicas=0
kubectl -n "$ns" wait --for=delete pod -l app=shop --timeout=120s || true
kubectl -n "$ns" delete idrop "$drop" --wait --timeout=60s || fail "deletion hung on the finalizer"
# Only the deletion tombstone stays (sidecars read it as "deleted", not as a config
# Redis lost).
left=$(redis --scan --pattern "$keys:*" | grep -v ':deleted$' | wc -l)
[ "$left" = 0 ] || fail "$left Redis keys left after deletion"
echo "e2e/kind: PASSED"
