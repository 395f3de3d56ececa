# Sourced by the device-call scripts (benchmarks/gpu_*.sh) from the repo root: unbuffered Python, $OUT, the carried
# wheels (.whl/, e.g. gguf, which the GPU image lacks) installed to /tmp/site, and this tree on PYTHONPATH.
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# the image has no gguf package: without the carried wheels every GGUF / IQ path fails at import, so stop the call now
python3 -c "import gguf" 2>/dev/null || { echo "FATAL: no gguf package here: run benchmarks/device_prep.sh and carry .whl"; exit 3; }
