# Sourced by the scripts that run on the GPU machine (gpu_dpo.sh, gpu_grpo.sh), from the repository root: sets
# $python and $out (created), installs the wheels carried in .whl/ into /tmp/site, puts them and the working tree on
# PYTHONPATH, keeps the hub offline (no network there: never wait on it) and prints torch's version and the GPU.
python=${PYTHON:-python3}
out=${OUT:-benchmarks}
mkdir -p "$out"

if compgen -G ".whl/*.whl" >/dev/null; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit
  export PYTHONPATH=/tmp/site:.${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
echo "$("$python" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA")')"
