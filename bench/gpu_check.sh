#!/usr/bin/env bash
# GPU check of the Triton kernels: the FPA timings first (the numbers a lent GPU is for), then
# correctness on the GPU, the other sections, and the short table last. Each section is one
# Python module run from the repository root; a failing section is reported and the next one
# still runs; the exit status is the first non-zero one. Budget: under 6 minutes on one H200.
#
# Run, from the repository root, on the GPU machine (one H200; Python 3.12 with torch, triton and
# jax preinstalled; no network):
#     make wheels                          # first, on a machine with network: .whl/ (carried)
#     bash bench/gpu_check.sh              # under 6 minutes
#     bash bench/gpu_check.sh --dry-run    # the same steps on CPU: Triton interpreter, tiny
#                                          # shapes, one timing repetition (CI runs this)
#     bash bench/gpu_check.sh --sections "kit fpa"     # a subset, in this order
# flash-linear-attention (fla-core, the timing peer) comes as wheels carried in .whl/ with what
# it imports (`make wheels`: fla-core, einops, packaging, pinned); they are installed into a
# temporary target. attnspec is imported from the checkout (no install).
# When $OUT is set, the results land there: fpa.json (rewritten after every timed row), kit.json,
# sections.txt and the summary as gpu_check.json and gpu_check.md.
#
# Sections:
#   fpa         python -m bench.gpu_bench timings      every kernel variant compiled in parallel
#               (a failed compile is a failure), a long check, then FPA, FoX, fla, SDPA timings
#               (a failing row is recorded and the run goes on); bf16 matmul peak
#   kit         python -m bench.gpu_bench kit          the conformance kit on the triton backend,
#               all ops and dtypes it declares, in parallel processes (one compiled variant per
#               process: a fresh machine has an empty Triton cache) merged into one report.
#               One process does the same, slower:
#               python -m attnspec.conformance --backend triton --device cuda
#   s4d         python -m bench.gpu_s4d                Interdomain kernels (when present)
#   pallas      python -m bench.gpu_pallas             JAX Pallas kernels (when present; on the
#               GPU only when jax sees one: its CPU interpreter would take hours at these sizes)
#   decode      python -m bench.decode --grid full      the paged FPA session with the Triton
#               decode kernel against SDPA decode: rows 1/8/32, context 1K/8K/32K, GQA 4:1 and
#               1:1, bf16 and float32, and the layers of E4's trained FPA at theta 16
#               (tokens/s, bytes held, kept/stored/paged fractions)
#   summary     python -m bench.gpu_bench summary      the short table, last
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=""
SECTIONS="fpa kit s4d pallas decode"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dry-run) DRY="--dry-run" ;;
        --sections) SECTIONS="$2"; shift ;;
        *) echo "gpu_check: unknown argument $1 (--dry-run, --sections \"...\")" >&2; exit 2 ;;
    esac
    shift
done

PY=${PYTHON:-python3}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
RESULTS=${OUT:-$WORK/results}
mkdir -p "$RESULTS"
: > "$RESULTS/sections.txt"

if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --target "$WORK/site" .whl/*.whl \
        && export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
elif [[ -z "$DRY" ]] && ! "$PY" -c "import fla" 2> /dev/null; then
    echo "gpu_check: no .whl/ and no fla: the ratios to fla will not be measured (make wheels)" >&2
fi
if ! "$PY" -c "import attnspec.reference" 2> /dev/null; then
    # attnspec is a namespace of the code folders: link them under a temporary root.
    mkdir -p "$WORK/src/attnspec"
    for folder in reference backends conformance theory; do
        ln -s "$PWD/$folder" "$WORK/src/attnspec/$folder"
    done
    export PYTHONPATH="$WORK/src${PYTHONPATH:+:$PYTHONPATH}"
fi

if [[ -n "$DRY" ]]; then
    export TRITON_INTERPRET=1  # before any import of triton
fi

STATUS=0
run_section() {
    local name=$1; shift
    echo
    echo "== $name: $*"
    local start=$SECONDS
    "$@"
    local code=$?
    echo "== $name: exit $code after $((SECONDS - start)) s"
    echo "$name $code $((SECONDS - start))" >> "$RESULTS/sections.txt"
    if [[ $STATUS -eq 0 ]]; then STATUS=$code; fi
}

for section in $SECTIONS; do
    case "$section" in
        kit) run_section kit "$PY" -m bench.gpu_bench kit $DRY --out "$RESULTS/kit.json" ;;
        fpa) run_section fpa "$PY" -m bench.gpu_bench timings $DRY --out "$RESULTS/fpa.json" ;;
        decode)
            run_section decode "$PY" -m bench.decode --grid full --device \
                "$([[ -n $DRY ]] && echo cpu || echo cuda)" --attention triton $DRY \
                --out "$RESULTS/decode.json" ;;
        s4d | pallas)
            if [[ $section == pallas && -z "$DRY" ]] && ! "$PY" -c \
                "import jax; assert jax.devices('gpu')" > /dev/null 2>&1; then
                echo "== pallas: jax sees no GPU (no CUDA plugin?), skipped"
            elif [[ -f "bench/gpu_$section.py" ]]; then
                run_section "$section" "$PY" -m "bench.gpu_$section" $DRY
            else
                echo "== $section: bench/gpu_$section.py not present, skipped"
            fi ;;
        *) echo "gpu_check: unknown section $section" >&2; STATUS=2 ;;
    esac
done

echo
"$PY" -m bench.gpu_bench summary --results "$RESULTS" || true
exit $STATUS
