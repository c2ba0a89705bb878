#!/usr/bin/env bash
# End-to-end on a kind cluster: the operator in Kubernetes, a drop applied with
# kubectl, a sale through the sidecar, the kill switch, and deletion.
# Needs Docker (a running engine), kind, kubectl and helm; skips where they are not.
# KEEP=1 keeps the cluster afterwards.
set -euo pipefail
cd "$(dirname "$0")/../.."

skip() { echo "e2e/kind: SKIPPED: $*" >&2; exit 0; }
for tool in docker kind kubectl helm; do
  command -v "$tool" >/dev/null 2>&1 || skip "$tool is not installed"
done
docker info >/dev/null 2>&1 || skip "no Docker engine is running (docker info failed)"

cluster=dropgate-e2e
ns=shop
fail() { echo "e2e/kind: FAILED: $*" >&2; kubectl -n dropgate-system logs deploy/dropgate-operator --tail=50 >&2 || true; exit 1; }
cleanup() { [ "${KEEP:-0}" = 1 ] || kind delete cluster --name "$cluster" >/dev/null 2>&1 || true; }
trap cleanup EXIT

kind get clusters | grep -qx "$cluster" || kind create cluster --name "$cluster" --wait 120s
docker build -t dropgate:e2e .
kind load docker-image dropgate:e2e --name "$cluster"

kubectl create namespace "$ns" --dry-run=client -o yaml | kubectl apply -f -
kubectl apply -f e2e/kind/redis.yaml
kubectl -n "$ns" rollout status deploy/redis --timeout=120s
helm upgrade --install dropgate charts/dropgate --namespace dropgate-system --create-namespace \
  --set image.tag=e2e --set image.pullPolicy=Never --set operator.resyncSeconds=5 --wait --timeout 180s

sed 's#redis://redis:6379#redis://redis.shop:6379#' examples/drop.yaml | kubectl apply -f -
kubectl -n "$ns" wait --for=condition=Ready inventorydrop/sneaker-0412 --timeout=120s || fail "the drop never became Ready"
kubectl -n "$ns" get idrop
[ "$(kubectl -n "$ns" get idrop sneaker-0412 -o jsonpath='{.status.remaining}')" = 100 ] || fail "status.remaining is not 100"
kubectl -n "$ns" get idrop sneaker-0412 -o jsonpath='{.metadata.finalizers}' | grep -q dropgate.io/cleanup || fail "no finalizer"

kubectl delete pod buyers -n "$ns" --ignore-not-found
kubectl apply -f e2e/kind/buyers.yaml
kubectl -n "$ns" wait --for=jsonpath='{.status.phase}'=Succeeded pod/buyers --timeout=180s || fail "the buyers pod did not finish"
admitted=$(kubectl -n "$ns" logs buyers -c shop | sed -n 's/^admitted=//p')
[ "$admitted" = 100 ] || fail "admitted $admitted of 100 units to 150 buyers"
for _ in $(seq 1 30); do
  [ "$(kubectl -n "$ns" get idrop sneaker-0412 -o jsonpath='{.status.remaining}')" = 0 ] && break
  sleep 2
done
[ "$(kubectl -n "$ns" get idrop sneaker-0412 -o jsonpath='{.status.phase}')" = SoldOut ] || fail "phase is not SoldOut"

kubectl -n "$ns" patch idrop sneaker-0412 --type merge -p '{"spec":{"gate":{"enabled":false}}}'
for _ in $(seq 1 30); do
  [ "$(kubectl -n "$ns" get idrop sneaker-0412 -o jsonpath='{.status.mode}')" = fail-open ] && break
  sleep 2
done
[ "$(kubectl -n "$ns" get idrop sneaker-0412 -o jsonpath='{.status.mode}')" = fail-open ] || fail "the kill switch did not reach status"
kubectl -n "$ns" get events --field-selector reason=FailOpenEnabled -o name | grep -q . || fail "no FailOpenEnabled Event"

kubectl -n "$ns" delete idrop sneaker-0412 --wait --timeout=60s || fail "deletion hung on the finalizer"
left=$(kubectl -n "$ns" exec deploy/redis -- redis-cli --scan --pattern 'dropgate:*' | wc -l)
[ "$left" = 0 ] || fail "$left Redis keys left after deletion"
echo "e2e/kind: PASSED"
