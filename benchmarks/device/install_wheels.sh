# Sourced by the device scripts (`source benchmarks/device/install_wheels.sh || exit 1`): the carried
# wheels ($WHEELS, default .wt/slim, from `kshapes_chain_device.sh wheels`) into /tmp/site, jieba
# without its LAC and POS models, and PYTHONPATH for them and this tree. --no-compile keeps the
# install short; cold_start_call.sh compiles bytecode itself where imports are what it measures.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "${WHEELS:-.wt/slim}"/*.whl && tar xzf "${WHEELS:-.wt/slim}"/jieba_slim.tgz -C /tmp/site || return 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
