#!/bin/sh
# The long-context retrieval run behind the qwen_n24 run of long_context_accuracy.{json,md,png}
# (each prompt's result in long_context_accuracy_qwen_n24.jsonl):
# Qwen2.5-Coder-0.5B, 24 prompts at 8K and 16K (4 tasks x 3 depths x 2 seeds), 12 at 32K
# (one seed). Hours on a small CPU, so it runs in phases whose partial results are already
# useful: every policy at 8K (with transformers as the reference: at 16K its generate peaks
# near 14 GB), then 16K, then InfiniGen with --speculation-query
# renorm and own at 8K and 16K, then 32K (what decides the default first), then H2O (its own
# prefill: the slowest policy, on one seed; 8K and 16K, then 32K).
#
# One prompt a round (--batch 1): a stopped run loses at most one prompt's prefill.
# Resumable: each (prompt, policy) result is appended to the JSONL as it completes and a rerun
# of this script skips what is there; prompts' prefills are kept in $PREFILL_DIR (several GB
# a length), so a policy added later only decodes. Run it in the background:
#   setsid nice -n 19 sh benchmarks/long_context_accuracy_qwen.sh > accuracy_run.log 2>&1 &
set -e
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's package
# at the lowest priority on a busy machine, spinning OpenMP threads waste the little time given
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
MODEL=${MODEL:-$HOME/.cache/flexgen_infinigen/gguf/qwen2.5-coder-0.5b-instruct.gguf}
DATA_DIR=${DATA_DIR:?set DATA_DIR to a folder with pg19_firstbook.txt and/or wikitext2_test.txt}
PREFILL_DIR=${PREFILL_DIR:-$HOME/.cache/flexgen_infinigen/prefills-accuracy}
# InfiniGen's default, and InfiniGen and the exact oracle at ~12% and ~6% relative KV (layers
# 0-1 read whole at L2: 2/24 + 22/24 * 0.04 = 0.120; from layer 1: 1/24 + 23/24 * 0.02 = 0.061)
# and the candidates: KIVI's 4-bit cache, InfiniGen with 8-bit speculation keys
POLICIES=${POLICIES:-"full infinigen infinigen@0.04 infinigen@0.02:L1 oracle@0.04 oracle@0.02:L1 full-4bit kivi infinigen-int8@0.04 infinigen-int8@0.02:L1"}
run() {
    python benchmarks/long_context_accuracy.py --model "$MODEL" --data-dir "$DATA_DIR" \
        --tag qwen_n24 --prefill-dir "$PREFILL_DIR" "$@"
}
# shellcheck disable=SC2086
run --lengths 8192 --seeds 2 --batch 1 --policies $POLICIES --reference-max-length 8192
# shellcheck disable=SC2086
run --lengths 16384 --seeds 2 --batch 1 --policies $POLICIES --reference-max-length 0
# --speculation-query renorm (a closer guess of the query at no cost: selection_recall.py)
# and own (no guess: each layer's own query; with 8-bit keys the oracle's choice there),
# from the kept prefills at 8K and 16K: whether one may become the default (before 32K,
# whose prefills take ~10 GB of disk: the 8K ones may be deleted once this phase is done)
run --lengths 8192 16384 --seeds 2 --batch 1 \
    --policies infinigen-renorm@0.04 infinigen-renorm@0.02:L1 infinigen-own@0.04 \
    infinigen-own-int8@0.04 --reference-max-length 0
# 32K: first what decides the default (full, the paper's query, the better queries, the
# oracle at 0.120), then the rest of the list from the kept prefills
run --lengths 32768 --seeds 1 --batch 1 --policies full infinigen infinigen@0.04 \
    infinigen-renorm@0.04 infinigen-own@0.04 oracle@0.04 infinigen-renorm@0.02:L1 \
    --reference-max-length 0
# shellcheck disable=SC2086
run --lengths 32768 --seeds 1 --batch 1 --policies $POLICIES --reference-max-length 0
run --lengths 8192 16384 --seeds 1 --batch 1 --policies h2o@0.12 --reference-max-length 0
# H2O at 32K too (the issue compares every length): its own 32K prefill per prompt, hours
run --lengths 32768 --seeds 1 --batch 1 --policies h2o@0.12 --reference-max-length 0
