#!/usr/bin/env bash
# Build `.gpu/`: what a session's lent GPU machine (the `device` tool) needs to run the CUDA checks offline.
#
# That machine has torch, transformers, xarray and peft, but no route to PyPI and no demo cache; what reaches it is
# the working tree (64 MiB with the carried paths). This script, run here (where PyPI is reachable), writes:
#   .gpu/whl/    wheels of what its image lacks (zarr, numcodecs, donfig, google-crc32c, gguf, cma; CPython 3.12,
#                manylinux x86_64, --no-deps: the image has the rest) and a wheel of this checkout of submerge;
#   .gpu/cache/  a tokenizer-only copy of the demo cache (config, tokenizer files and a placeholder for the 517 MB
#                weights, which cannot travel): `benchmarks/scale.py` builds its Llama-2-7B-shaped slices from the
#                demo base's tokenizer only (SUBMERGE_CACHE=$PWD/.gpu/cache);
#   .gpu/run.sh  the device call: install the wheels into /tmp/site, then the checks the README asks for (the
#                CUDA-only tests, and benchmarks/scale.py at L = 1, 2, plain and --offload) within one 10-minute call.
# `.gpu/` is kept out of git (.git/info/exclude). Then, in a session with a device:
#   run(command="bash .gpu/run.sh", carry=[".gpu"], timeout_s=600)
# Rebuild the kit after changing the code (the submerge wheel is this checkout's).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD KIT=$PWD/.gpu
PYTHON=${PYTHON:-python3}
mkdir -p "$KIT/whl" "$KIT/cache"
grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude
rm -f "$KIT"/whl/*.whl
# the versions this environment runs (what the tests passed on), for the device's CPython 3.12
PINNED=$("$PYTHON" -c "import importlib.metadata as m; print(' '.join(f'{p}=={m.version(p)}' for p in
    ('zarr', 'numcodecs', 'donfig', 'google-crc32c', 'gguf', 'cma')))")
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$KIT/whl" $PINNED
"$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$KIT/whl" "$ROOT"
CACHE=${SUBMERGE_CACHE:-$HOME/.cache/submerge}
BASE=$CACHE/smollm2-135m-instruct-fp32
[ -f "$BASE/tokenizer.json" ] || { echo "no demo base at $BASE: run the README's demo command once first" >&2; exit 1; }
mkdir -p "$KIT/cache/smollm2-135m-instruct-fp32"
for f in "$BASE"/*; do
  case "$(basename "$f")" in *.safetensors) ;; *) cp -r "$f" "$KIT/cache/smollm2-135m-instruct-fp32/" ;; esac
done
printf 'placeholder: the weights do not travel' > "$KIT/cache/smollm2-135m-instruct-fp32/model.safetensors"
[ -d "$CACHE/demo-data-v1" ] && cp -r "$CACHE/demo-data-v1" "$KIT/cache/"
cat > "$KIT/run.sh" <<'RUN'
#!/usr/bin/env bash
# One device call (run from the repository root on the device machine): the wheels, then the CUDA-only tests and
# benchmarks/scale.py at L = 1, 2 (plain: linearity and interference; --offload: linearity). Results under $OUT.
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH SUBMERGE_CACHE=$PWD/.gpu/cache
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; free -g | head -2
  python3 -c "import torch, transformers, xarray, zarr, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'xarray', xarray.__version__, 'zarr', zarr.__version__, 'peft', peft.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/env.txt"
echo "== setup done at $(( $(date +%s) - T0 )) s"
timeout 120 python3 -m pytest tests -k "cuda or offload or gpu_with_room" -q -p no:cacheprovider -rs 2>&1 | tee "$OUT/cuda_tests.txt"
echo "== tests done at $(( $(date +%s) - T0 )) s"
mkdir -p /tmp/scale
timeout 230 python3 benchmarks/scale.py --layers 1,2 --device cuda --offload --commands linearity --keep /tmp/scale --results "$OUT/offload.json" 2>&1 | tee "$OUT/offload.txt"
echo "== offload done at $(( $(date +%s) - T0 )) s"
left=$(( 565 - ($(date +%s) - T0) ))
timeout $left python3 benchmarks/scale.py --layers 1,2 --device cuda --commands linearity,interference --keep /tmp/scale --results "$OUT/plain.json" 2>&1 | tee "$OUT/plain.txt"
echo "== plain done at $(( $(date +%s) - T0 )) s"
RUN
du -sh "$KIT"
echo "kit ready: run(command=\"bash .gpu/run.sh\", carry=[\".gpu\"], timeout_s=600)"
