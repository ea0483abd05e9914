#!/usr/bin/env bash
# GPU check of the Triton kernels: the FPA timings first (the numbers a lent GPU is for), then
# correctness on the GPU, the other sections, and the short summary last. Each section is one
# Python module run from the repository root, writing its file into one results folder; a
# failing section is reported and the next one still runs; the exit status is the first
# non-zero one.
#
# Run, from the repository root, on the GPU machine (one H100 or H200; Python 3.12 with torch,
# triton, jax, transformers and safetensors preinstalled; attnspec not installed; no network):
#     make wheels                          # first, on a machine with network: .whl/ (carried)
#     bash bench/gpu_check.sh              # the default sections, under 8 minutes (below)
#     bash bench/gpu_check.sh --dry-run    # the same steps on CPU: Triton interpreter, tiny
#                                          # shapes, one timing repetition (CI runs this with
#                                          # the GPU machine's stack: bench/matrix.py, gpu-image)
#     bash bench/gpu_check.sh --sections "kit fpa"     # a subset, in this order ("all": every one)
# What the sections need beyond the machine's image comes as wheels in .whl/ (`make wheels`:
# flash-linear-attention, the timing peer, and what it imports), installed into a temporary
# target. attnspec is imported from the checkout: when it is not installed, the package is built
# in a temporary folder from links (src/attnspec's files and the code folders of pyproject.toml's
# package-dir), so every subpackage and `attnspec.__version__` import as from an install.
# Results: $OUT when set, else out/gpu_check/ (printed at the end): sections.txt, fpa.json,
# kit.json, s4d.json, decode.json (pallas.json), every file rewritten as its rows are measured,
# and the summary (every ratio to a peer, under 4,000 characters) as gpu_check.json and
# gpu_check.md, printed last.
#
# Sections (default: fpa kit s4d decode; pallas when named or with "all"):
#   fpa         python -m bench.gpu_bench timings      every kernel variant compiled in parallel
#               (a failed compile is a failure), a long check, then FPA, FoX, fla's
#               parallel_forgetting_attn and SDPA, fwd and fwd+bwd; rows after its budget skipped
#   kit         python -m bench.gpu_bench kit          the conformance kit on the triton backend,
#               all ops and dtypes it declares, in parallel processes (one compiled variant per
#               process: a fresh machine has an empty Triton cache) merged into one report
#   s4d         python -m bench.gpu_s4d                the S4D kernels against fla's chunk_gla
#   decode      python -m bench.decode --grid gpu      the paged FPA session with the Triton
#               decode kernel against SDPA, fla's attn_decoding_one_step and FlashAttention's
#               flash_attn_with_kvcache (where installed; a line says which are not), its step
#               compiled and replayed from a CUDA graph, and E4's trained layers; configurations
#               after its budget skipped
#   pallas      python -m bench.gpu_pallas             JAX Pallas and Mosaic GPU kernels (only
#               when jax sees a GPU: its CPU interpreter would take hours at these sizes)
#   summary     python -m bench.gpu_bench summary      the summary, last
#
# Time (default sections, one H100/H200, a fresh Triton cache; estimated, not yet measured: no
# GPU has been lent). A section's time is its Triton compilations x about 2 s of one CPU core
# each (the sm_90 compiles of bench/gpu_static*.py take 1-3 s a kernel on a CPU) / the processes
# compiling in parallel, plus its timed work, capped by a budget where the section has one:
#   fpa     13 variants x ~8 kernels on 16 processes ~ 15 s; long check ~ 15 s; timing rows
#           (fla autotunes its kernels at their first call) cut at FPA_BUDGET = 110 s; sweep
#           ~ 10 s                                                                   ~ 150 s
#   kit     448 cases, ~100 distinct kernels, compiled per process on 16 processes  ~ 120 s
#   s4d     ~36 compilations in one process (2 check dtypes x 2 readouts, 2 dv, the 16-row
#           tiling; forward and backward kernels) ~ 75 s; timings ~ 15 s              ~ 90 s
#   decode  the decode and combine kernels per (GQA ratio, head dim, dtype): 6; fla's decode
#           autotuned over 12 configurations for each of its 4 keys; 4 compiled steps
#           (torch.compile, ~15 s each); configurations cut at DECODE_BUDGET = 90 s  ~ 100 s
#   total                                                                            ~ 460 s
# pallas (~2 minutes) would take the run past 8 minutes: it runs when named.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=""
SECTIONS="fpa kit s4d decode"
FPA_BUDGET=110
DECODE_BUDGET=90
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dry-run) DRY="--dry-run" ;;
        --sections)
            SECTIONS="$2"
            shift
            if [[ $SECTIONS == all ]]; then SECTIONS="fpa kit s4d pallas decode"; fi ;;
        *) echo "gpu_check: unknown argument $1 (--dry-run, --sections \"...\")" >&2; exit 2 ;;
    esac
    shift
done

PY=${PYTHON:-python3}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
RESULTS=${OUT:-$PWD/out/gpu_check}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
export OUT="$RESULTS"  # (bench/gpu_pallas.py writes $OUT/pallas.json)
rm -f "$RESULTS"/{sections.txt,fpa.json,kit.json,s4d.json,decode.json,pallas.json,gpu_check.*}
: > "$RESULTS/sections.txt"

if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --target "$WORK/site" .whl/*.whl \
        && export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
elif ! "$PY" -c "import fla" 2> /dev/null; then
    echo "gpu_check: no .whl/ and no fla: the ratios to fla will not be measured (make wheels)" >&2
fi
if ! "$PY" -c "import attnspec.reference" 2> /dev/null; then
    # attnspec from links: its own files (src/attnspec) and each code folder under its name
    mkdir -p "$WORK/src/attnspec"
    ln -s "$PWD"/src/attnspec/*.py "$WORK/src/attnspec/"
    "$PY" - "$WORK/src/attnspec" << 'EOF' || exit 2
import os, sys, tomllib
with open("pyproject.toml", "rb") as fh:
    folders = tomllib.load(fh)["tool"]["setuptools"]["package-dir"]
for package, folder in folders.items():
    if package.startswith("attnspec."):
        os.symlink(os.path.abspath(folder), os.path.join(sys.argv[1], package.split(".", 1)[1]))
EOF
    export PYTHONPATH="$WORK/src${PYTHONPATH:+:$PYTHONPATH}"
fi

if [[ -n "$DRY" ]]; then
    export TRITON_INTERPRET=1  # before any import of triton
    # Triton 3.6's interpreter with numpy >= 2.4 (the GPU machine's pair; bench/dry_run/)
    export PYTHONPATH="$PWD/bench/dry_run${PYTHONPATH:+:$PYTHONPATH}"
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
        fpa)
            run_section fpa "$PY" -m bench.gpu_bench timings $DRY --budget "$FPA_BUDGET" \
                --out "$RESULTS/fpa.json" ;;
        kit) run_section kit "$PY" -m bench.gpu_bench kit $DRY --out "$RESULTS/kit.json" ;;
        s4d) run_section s4d "$PY" -m bench.gpu_s4d $DRY --out "$RESULTS/s4d.json" ;;
        decode)
            if [[ -n "$DRY" ]]; then
                run_section decode "$PY" -m bench.decode --dry-run --out "$RESULTS/decode.json"
            else
                run_section decode "$PY" -m bench.decode --grid gpu --device cuda \
                    --attention triton --budget "$DECODE_BUDGET" --out "$RESULTS/decode.json"
            fi ;;
        pallas)
            if [[ -z "$DRY" ]] && ! "$PY" -c \
                "import jax; assert jax.devices('gpu')" > /dev/null 2>&1; then
                echo "== pallas: jax sees no GPU (no CUDA plugin?), skipped"
            else
                run_section pallas "$PY" -m bench.gpu_pallas $DRY
            fi ;;
        *) echo "gpu_check: unknown section $section" >&2; STATUS=2 ;;
    esac
done

echo
echo "gpu_check: results in $RESULTS"
"$PY" -m bench.gpu_bench summary --results "$RESULTS" || true
exit $STATUS
