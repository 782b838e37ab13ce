#!/bin/bash
# Sourced on the GPU machine after gpu_setup.sh, by the scripts that run Ray (gpu_harvest.sh):
# joins the Ray wheel that prepare_ray.sh split and installs Ray Data with the wheels beside it
# into the machine's Python, which keeps the packages it already has (numpy, ...).
parts=/tmp/vlens-parts
if ! python3 -c "import ray.data" 2>/dev/null; then
  wheels=/tmp/vlens-ray-wheels && mkdir -p $wheels
  cat "$parts"/ray.whl.part.* > "$wheels/$(cat "$parts/ray.whl.name")"
  cp "$parts"/*.whl $wheels/
  python3 -m pip install -q --no-index --find-links $wheels "ray[data]==2.60.0" \
    || python3 -m pip install -q --user --no-index --find-links $wheels "ray[data]==2.60.0" \
    || return 1
fi
python3 -c "import ray; print('ray', ray.__version__)" || return 1
