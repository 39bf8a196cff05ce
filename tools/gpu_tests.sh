#!/usr/bin/env bash
# On the GPU machine, from the repo root (after tools/gpu_bundle.sh here; carry .gpu/tok and .gpu/data): the GPU
# tests with every input they look for, so that none skips for a missing file. The real-data tests read the
# training file from .gpu/data (../shared does not travel) and the SmolLM2 tokenizer from .gpu/tok.
#
#   tools/gpu_tests.sh [pytest args...]      e.g. tools/gpu_tests.sh -k "real_data or fp8"
#
# Prints the skip reasons (-rs) and, with $OUT set, writes the whole log to $OUT/pytest.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
data=.gpu/data/smollm2-sharegpt-regen.jsonl.gz
for need in "$data" .gpu/tok/tokenizer.json; do
  [ -f "$need" ] || { echo "missing $need: run tools/gpu_bundle.sh here and carry .gpu/data and .gpu/tok" >&2; exit 2; }
done
export DFLASH_TEST_REAL_DATA=$PWD/$data DFLASH_TEST_TOKENIZER_DIR=$PWD/.gpu/tok PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/src${DFLASH_SITE:+:$DFLASH_SITE}${PYTHONPATH:+:$PYTHONPATH}
log=${OUT:-/tmp}/pytest.txt
rc=0
python3 -m pytest -p no:cacheprovider -m gpu tests/test_gpu.py -rs -v --timeout=400 "$@" > "$log" 2>&1 || rc=$?
grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|^E " "$log" | cut -c1-300 || true
echo "pytest rc=$rc (log: $log)"
exit $rc
