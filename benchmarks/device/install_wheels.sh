# Sourced by the device scripts (`source benchmarks/device/install_wheels.sh || exit 1`): the carried
# wheels ($WHEELS, default .wt/slim, from `kshapes_chain_device.sh wheels`) into /tmp/site, jieba
# without its LAC and POS models, and PYTHONPATH for them and this tree. --no-compile keeps the
# install short; cold_start_call.sh compiles bytecode itself where imports are what it measures.
# A warm machine keeps /tmp: the same wheels (names and sizes) already installed are not installed
# again, and a call that carries no wheels at all uses those installed by an earlier call.
if [ ! -d "${WHEELS:-.wt/slim}" ] && [ -f /tmp/site/.wheels ]; then
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
  return 0
fi
_stamp=$(ls -l "${WHEELS:-.wt/slim}"/ | awk '{print $5, $9}')
if [ "$(cat /tmp/site/.wheels 2>/dev/null)" != "$_stamp" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "${WHEELS:-.wt/slim}"/*.whl && tar xzf "${WHEELS:-.wt/slim}"/jieba_slim.tgz -C /tmp/site \
    && echo "$_stamp" > /tmp/site/.wheels || return 1
fi
unset _stamp
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
